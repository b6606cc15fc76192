"""CI's one-minute soak: ``bench/soak.py --minutes 1`` meets every kind of fault and its audit
passes: every log contiguous and legal, its snapshot its fold, its tokens those of an
uninterrupted run, every rollout ended and delivered once, none failed, no token lost, and
Redis back at its baseline once everything is acknowledged (strict); and no ``worker_lost``
charged to a live worker (reported by a non-strict xfail, ``KNOWN`` below).

Both failed, more and more rarely, until issue 28's last fixes: rq jobs of killed workers'
runs swept back after their rollouts were acknowledged, and a success recorded as its rollout
was acknowledged by a worker killed before its next round trip (tests/workers/
test_ack_races.py); a live worker's leases lapsed during a short OOM and reaped by a reaper
whose worker had not seen the refusals (tests/workers/test_refusal_grace.py), a job delivered
again to the worker running it (tests/workers/test_runner.py) because rq stamped executions
with a host clock stepped back (tests/workers/test_clock_skew.py), lease renewals waiting
behind rq's bookkeeping (tests/workers/test_heartbeat.py), and presence judging a live worker
gone when its link turned slow and dropped its one subscription (test_slow_link.py).

It runs here, in the suite, rather than after it in ``.ci/run``: one verdict for CI, under
pytest's timeout, with the soak's figures in the failure message; and beside the other tests'
processes the machine is loaded, which is when leases, presence checks and clocks are tested
hardest (issue 28's defects were found under load). ~90-120 s: a redis-server, the API and
three synthetic-engine workers (one under libfaketime: ``apt-get install faketime``, as
``.ci/run`` does)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from soak_faults import KINDS  # bench/ is on the path (tests/bench/conftest.py)

from tests.bench.smoke import run

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


# A rarer cause remains (not yet fixed): a worker whose presence subscription comes back
# later than presence's grace after a Redis start (5 s) is judged gone within its confirmation
# window, shorter than its heartbeat (a 30-minute soak: 3 ``process_gone`` of a plain worker);
# and a lease that lapsed while Redis was down can be reaped by the first reaper to reconnect.
# (The clock worker's share came from libfaketime slowing its GIL: fixed, bench/soak_fleet.py.)
# Reported in every CI run by a test of its own (xfailed, or xpassed), so that CI keeps every
# other check strict.
KNOWN = ("no_worker_lost_of_a_live_worker",)


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    logs = tmp_path_factory.mktemp("soak") / "logs"
    done = run(
        "soak.py", "--minutes", "1", "--seed", "1",
        # Faults 5 s apart on average: the seven kinds all come within the minute.
        "--fault-every", "5", "--drain-timeout", "90", "--logs", str(logs),
        timeout=450,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def _summary(report: dict[str, Any]) -> str:
    return json.dumps(
        {k: report[k] for k in ("faults", "rollouts_by_status", "aborts_by_reason", "budgets",
                                "tokens_lost_by_cause", "trainer_retries", "problem_logs")},
        indent=1,
    )  # fmt: skip


@pytest.mark.timeout(480)
def test_one_minute_soak_passes_its_audit(soak: tuple[dict[str, Any], Any]) -> None:
    report, _ = soak
    failing = {k: v for k, v in report["audit"].items() if not v["passed"] and k not in KNOWN}
    summary = _summary(report)
    assert {k for k, n in report["faults"].items() if n} == set(KINDS), summary
    assert report["rollouts_submitted"] >= 64 and report["tokens_saved"] > 0, summary
    assert report["tokens_lost"] == 0, summary
    assert not failing, json.dumps(failing, indent=1) + "\n" + summary


@pytest.mark.timeout(480)
@pytest.mark.xfail(
    strict=False,
    reason="known, rarer since session 16: a live worker slow to reconnect after a Redis "
    "restart judged gone (presence's grace after the start), or its lapsed lease reaped",
)
def test_one_minute_soak_passes_the_known_open_checks(soak: tuple[dict[str, Any], Any]) -> None:
    report, done = soak
    open_checks = {k: report["audit"][k] for k in KNOWN}
    assert all(v["passed"] for v in open_checks.values()), json.dumps(open_checks, indent=1)
    assert report["passed"] and done.returncode == 0, done.stderr[-3000:]
