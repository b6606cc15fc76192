"""``bench/bench_recovery.py --quick --json`` runs end to end and reports every figure; with
workers that cannot start it fails at once with their error, where it used to wait forever
for them to register; the plain-rq baseline's job (skipped at the quick size: rq's own
recovery takes ~95 s) generates a rollout and records its progress."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from store.redis_server import RedisServer
from tests.bench.smoke import assert_finite, figures, run

# Each run starts a redis-server and two worker processes (CPU engines), one kill round.
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

FIGURES = (
    "recovery_s",
    "recovery_s_max",
    "detect_s",
    "reopen_s",
    "first_tokens_s",
    "tokens_regenerated",
    "decode_tokens_per_s",
    "persisted_at_kill",
    "presence_numsub_calls",
)


def test_quick_bench_reports_every_figure() -> None:
    result = figures("bench_recovery.py", "--quick")
    assert_finite(result, FIGURES)
    assert result["kill_rounds"] == 1 and len(result["kill_how"]) == 1
    # The parts the quick size skips say so.
    assert result["rq_recovery_s"] is None and result["speedup"] is None
    assert result["stop_recovery_s"] is None and result["stop_how"] == []


def test_workers_that_cannot_start_fail_it_at_once(tmp_path: Path) -> None:
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    t0 = time.monotonic()
    # Before: it waited forever for the workers to register (here: the subprocess timeout).
    done = run("bench_recovery.py", "--quick", "--model", str(not_a_model), timeout=180)
    assert done.returncode != 0, done.stdout
    assert "watch.Died: worker kill0-" in done.stderr, done.stderr[-3000:]
    assert f"cannot start the CPU engine on {not_a_model}" in done.stderr, done.stderr[-3000:]
    # Most of it is the workers' own start (torch imports; ~10 s here, up to ~35 s on a busy
    # machine); noticing their exit takes ~0.1 s (tests/bench/test_watch.py).
    assert time.monotonic() - t0 < 120


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


def test_the_rq_baseline_job_generates_and_counts(
    server: RedisServer, tiny_dense_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rq_baseline_job import PROGRESS, generate

    monkeypatch.setenv("RQBENCH_REDIS", server.url)
    assert generate(str(tiny_dense_dir), [101, 7, 350], 12) == 12
    r = Redis.from_url(server.url)
    assert r.hgetall(PROGRESS) == {b"executions": b"1", b"1": b"12"}
    r.close()
