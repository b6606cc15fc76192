"""The operator commands on a real redis-server: `status`, `show`, `stuck`, `cancel`, `requeue`.

The abort-and-resume scenario runs real worker processes (synthetic engine): worker a is
killed with SIGKILL mid-rollout and worker b's reaper and engine finish it. `stuck` is set up by
a stand-in worker that writes the events a real one would (tests/store/trainer.py) and then
"dies" in the three ways that strand a rollout; a real worker process then finishes what
`requeue` gave back. The commands run in-process through `workers.cli.main` (in a thread: each
runs its own event loop), and as a subprocess where the wiring is the point.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from statemachine import Aborted, AbortReason, RolloutRequest, Status
from store.client import RolloutClient
from store.event_store import JOB
from store.keys import Keys
from store.leases import Leases
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests.store.trainer import checkpoint, dump, finish, start
from tests.workers.helpers import SYNTHETIC, greedy, random_prompts, start_worker, stop, until
from workers.cli import main

pytestmark = pytest.mark.redis_server

FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")
K = 8  # start_worker checkpoints every 8 tokens


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def request(n: int, seed: int = 0) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=random_prompts(1, seed, length=5)[0], sampling=greedy(n))


async def test_status_and_show_after_an_abort_and_a_resume_on_another_worker(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    await client.publish_weights(1, "/ckpt/1")
    [rid] = await client.submit([request(96)], batch_id="ops")
    a = start_worker(server.url, SYNTHETIC, "a", tmp_path / "a.log", *FAST, concurrency=1)
    b = None
    try:
        await until(lambda: _tokens_at_least(client, rid, 2 * K), what="worker a never saved")
        a.kill()  # SIGKILL: its lease lapses; b's reaper aborts it (worker_lost) and requeues
        a.wait(10)
        saved = (await client.store.load(rid)).num_tokens
        b = start_worker(server.url, SYNTHETIC, "b", tmp_path / "b.log", *FAST, concurrency=1,
                         synthetic={"token_delay_s": 0.0})  # fmt: skip
        [result] = await client.wait([rid], timeout=120)
        assert result.status is Status.DONE
        await until(lambda: _worker_beating(client, "b"), what="worker b never beat")

        await _check_status(server.url, capsys)
    finally:
        stop(a, *(p for p in [b] if p))

    events = await client.store.events(rid)
    [abort] = [e for e in events if isinstance(e, Aborted)]
    assert abort.reason is AbortReason.WORKER_LOST
    code, out, err = await cli(capsys, "show", rid, "--redis", server.url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"rollout {rid}: done, 96 tokens (v1: 96), 2 attempts"
    assert "batch ops, group 0, sample 0 of 1; prompt 5 tokens, max_tokens 96" in lines[1]
    timeline = "\n".join(lines)
    assert "attempt 1 started on worker a, weights v1" in timeline
    assert f"attempt 1 aborted: worker_lost ({abort.detail}); {saved} tokens saved" in timeline
    assert f"attempt 2 resumed on worker b from {saved} saved tokens, weights v1" in timeline
    assert "finished: length; 96 tokens in total" in timeline
    # The job of killed worker a stays "started" in rq until its execution TTL lapses.
    assert lines[-1].startswith("now: ended (done)")
    # Checkpoints are summarized per attempt, not a line per chunk.
    assert len(lines) == 2 + 7 + 1

    await _check_show_json(rid, saved, server.url, capsys)
    await client.aclose()


async def _check_status(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """After the rollout finished, with worker b alive and a killed."""
    # As a subprocess: the command's wiring, end to end.
    done = run_cli("status", "--redis", url)
    assert done.returncode == 0, done.stderr
    assert "done 1" in done.stdout and "failed 0" in done.stdout
    assert "latest v1 (/ckpt/1)" in done.stdout
    [row] = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["b"]]
    assert row[1:4] == ["0", "v1", "0"]  # in flight, weights, lag
    code, out, _ = await cli(capsys, "status", "--redis", url, "--json")
    status = json.loads(out)
    assert code == 0
    assert status["rollouts"]["done"] == 1 and status["rollouts"]["generating"] == 0
    assert status["latest_weights"]["version"] == 1
    [worker] = [w for w in status["workers"] if w["worker_id"] == "b"]
    assert worker["weight_version"] == 1 and worker["weight_lag"] == 0
    assert worker["in_flight"] == 0 and 0 <= worker["heartbeat_age_s"] < 5
    assert status["queues"] == {"rollouts": 0}


async def _check_show_json(
    rid: str, saved: int, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await cli(capsys, "show", rid, "--json", "--redis", url)
    assert code == 0
    shown = json.loads(out)
    assert [e["kind"] for e in shown["entries"]] == [
        "submitted", "started", "checkpoints", "aborted", "resumed", "checkpoints", "finished",
    ]  # fmt: skip
    started, ck1, aborted, resumed, ck2 = shown["entries"][1:6]
    assert (started["worker_id"], resumed["worker_id"]) == ("a", "b")
    assert aborted["reason"] == "worker_lost" and aborted["tokens"] == saved == ck1["tokens"]
    assert resumed["tokens"] == saved and ck2["tokens"] == 96 - saved
    assert ck1["by_version"] == {"1": saved} and shown["tokens_by_weight_version"] == {"1": 96}
    assert ck1["checkpoints"] >= saved // (2 * K)
    assert shown["status"] == "done" and shown["now"]["lease_expiry_ms"] is None


async def _tokens_at_least(client: RolloutClient, rid: str, n: int) -> bool:
    return (await client.store.load(rid)).num_tokens >= n


async def _worker_beating(client: RolloutClient, name: str) -> bool:
    return any(w.worker_id == name for w in (await client.stats()).workers)


async def test_show_of_an_unknown_rollout_is_one_line_and_exit_1(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await cli(capsys, "show", "nope", "--redis", server.url)
    assert (code, out, err) == (1, "", "rollouts show: error: no rollout 'nope'\n")
    code, _, err = await cli(capsys, "show", "bad id", "--redis", server.url)
    assert (
        code == 2
        and err.startswith("rollouts show: error: rollout id must be")
        and (err.count("\n") == 1)
    )
    code, _, err = await cli(capsys, "--debug", "show", "bad id", "--redis", server.url)
    assert code == 2 and "Traceback (most recent call last)" in err
    code, _, err = await cli(capsys, "show", "x", "--redis-url-file", "/nonexistent/url")
    assert code == 2 and err == (
        "rollouts show: error: cannot read the Redis URL file /nonexistent/url: FileNotFoundError\n"
    )


async def test_stuck_lists_each_kind_and_requeue_makes_them_finish(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    conn = Redis.from_url(server.url)
    url = server.url
    ids = ["nojob", "quarantined", "lapsed", "waiting"]
    await client.submit([request(24, i) for i in range(4)], ids=ids, batch_id="stk")
    leases = Leases(client.redis)
    await _strand(client, conn)
    code, out, _ = await cli(capsys, "stuck", "--json", "--redis", url)
    assert code == 0
    found = {s["rollout_id"]: s for s in json.loads(out)}
    assert {rid: s["kind"] for rid, s in found.items()} == {
        "nojob": "no_job", "quarantined": "quarantined", "lapsed": "lease_expired",
    }  # fmt: skip
    assert found["quarantined"]["why"] == "quarantined: CodecError: from newer code"
    assert found["lapsed"]["worker_id"] == "ghost" and found["lapsed"]["tokens"] == 8
    assert found["nojob"]["status"] == "pending"
    code, out, _ = await cli(capsys, "stuck", "--redis", url)
    assert out.splitlines()[0] == "3 stuck rollouts:"
    assert "lease of worker ghost (attempt 1) expired" in out
    assert "pending with 0 saved tokens and no rq job to run it" in out

    # Refused, one line each time, and nothing written: an id with a job, an unknown id, and
    # a good id beside either.
    before = await dump(client.redis)
    for argv, why in [
        (["waiting"], "rollout 'waiting' already has job "),
        (["nojob", "nope"], "no rollout 'nope'"),
    ]:
        code, out, err = await cli(capsys, "requeue", *argv, "--redis", url)
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert err.startswith("rollouts requeue: error: ") and why in err
        assert err.endswith(": nothing requeued\n")
    assert await dump(client.redis) == before

    code, out, err = await cli(capsys, "requeue", "nojob", "quarantined", "lapsed", "--redis", url)
    assert code == 0, err
    assert out.splitlines() == [
        "requeued nojob on rollouts: pending, starts from the prompt",
        "requeued quarantined on rollouts: attempt 1 on ghost is taken over by the next worker, "
        "which resumes from 0 saved tokens; out of quarantine",
        "requeued lapsed on rollouts: attempt 1 on ghost is taken over by the next worker, "
        "which resumes from 8 saved tokens",
    ]
    assert await leases.quarantined() == {}
    code, out, _ = await cli(capsys, "stuck", "--redis", url)
    assert (code, out) == (0, "no stuck rollouts\n")
    # Requeued once: a second requeue would be a second job for a rollout that has one.
    code, _, err = await cli(capsys, "requeue", "lapsed", "--redis", url)
    assert code == 1 and "rollout 'lapsed' already has job" in err

    c = start_worker(url, SYNTHETIC, "c", tmp_path / "c.log", *FAST, concurrency=4,
                     synthetic={"token_delay_s": 0.0})  # fmt: skip
    try:
        results = await client.wait(ids, timeout=120)
    finally:
        stop(c)
    assert [r.status for r in results] == [Status.DONE] * 4
    assert all(len(r.response_token_ids) == 24 for r in results)
    code, out, _ = await cli(capsys, "show", "lapsed", "--redis", url)
    assert "attempt 1 started on worker ghost" in out
    assert "attempt 1 aborted: worker_lost" in out  # taken over, or reaped first by c
    assert "attempt 2 resumed on worker c from 8 saved tokens" in out
    code, _, err = await cli(capsys, "requeue", "nojob", "--redis", url)
    assert (code, err) == (
        1, "rollouts requeue: error: rollout 'nojob' has ended (done): nothing requeued\n"
    )  # fmt: skip
    conn.close()
    await client.aclose()


async def test_a_requeue_whose_enqueue_fails_forgets_nothing(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Already right: the job is pushed before the quarantine entry is dropped, so a refused
    # enqueue (here the queue key made a string: WRONGTYPE, as under Redis OOM) leaves the
    # rollout listed as stuck, and the same command works once the cause is gone.
    client, conn, url = RolloutClient(server.url), Redis.from_url(server.url), server.url
    await client.submit([request(8)], ids=["q1"], batch_id="rq")
    _delete_job(conn, "q1")
    await Leases(client.redis).take("q1", -10)
    expiry = await Leases(client.redis).expiry("q1")
    assert expiry is not None
    assert await Leases(client.redis).quarantine("q1", expiry, "CodecError: from newer code")
    key = rollout_queue(conn).key
    conn.set(key, "not a list")
    code, out, err = await cli(capsys, "requeue", "q1", "--redis", url)
    assert code == 1 and out == "" and "WRONGTYPE" in err
    assert await Leases(client.redis).quarantined() == {"q1": "CodecError: from newer code"}
    conn.delete(key)
    code, out, _ = await cli(capsys, "stuck", "--json", "--redis", url)
    assert [s["rollout_id"] for s in json.loads(out)] == ["q1"]
    code, out, err = await cli(capsys, "requeue", "q1", "--redis", url)
    assert code == 0, err
    assert await Leases(client.redis).quarantined() == {}
    assert rollout_queue(conn).count == 1
    conn.close()
    await client.aclose()


async def _strand(client: RolloutClient, conn: Redis) -> None:
    """Leave three rollouts stranded the three ways ``stuck`` knows, with no worker running."""
    store, leases = client.store, Leases(client.redis)
    # A pending rollout whose job was deleted.
    _delete_job(conn, "nojob")
    # A worker took "lapsed", saved 8 tokens and died with its job: the lease is expired and
    # no worker (so no reaper) runs.
    await checkpoint(store, await start(store, "lapsed", "ghost"), 8)
    _delete_job(conn, "lapsed")
    await leases.take("lapsed", -10)
    # A reaper could not read "quarantined" and set it aside with the reason.
    await start(store, "quarantined", "ghost")
    _delete_job(conn, "quarantined")
    await leases.take("quarantined", -10)
    expiry = await leases.expiry("quarantined")
    assert expiry is not None and expiry < (await leases.read()).now_ms
    assert await leases.quarantine("quarantined", expiry, "CodecError: from newer code")


def _delete_job(conn: Redis, rid: str) -> None:
    job_id = conn.hget(Keys().snapshot(rid), JOB)
    assert job_id is not None
    Job.fetch(job_id.decode(), connection=conn, serializer=JSONSerializer).delete()


async def test_cancel_a_live_and_an_ended_rollout_and_a_batch(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    store, url = client.store, server.url
    await client.submit([request(16, i) for i in range(3)], ids=["live", "ended", "idle"])
    await checkpoint(store, await start(store, "live"), 4)
    await finish(store, "ended")

    code, out, err = await cli(capsys, "cancel", "live", "ended", "--redis", url)
    assert code == 0, err
    assert out.splitlines() == ["cancelled 1: live", "already ended 1: ended (done)"]
    live = await store.load("live")
    assert live.status is Status.CANCELLED and live.num_tokens == 4
    events = await store.events("live")
    assert events[-1].reason == "cancelled by an operator"  # type: ignore[attr-defined]

    # An unknown id among them: nothing is cancelled.
    code, out, err = await cli(capsys, "cancel", "idle", "nope", "--redis", url)
    assert (code, out) == (1, "")
    assert err == "rollouts cancel: error: no rollout 'nope': nothing cancelled\n"
    assert (await store.load("idle")).status is Status.PENDING
    code, _, err = await cli(capsys, "cancel", "--redis", url)
    assert code == 2 and "name rollout IDs or --batch B" in err

    batch = await client.submit([request(16, i) for i in range(4)], n=2, batch_id="bx")
    await finish(store, batch[0])
    code, out, _ = await cli(capsys, "cancel", "--batch", "bx", "--group", "0", "--redis", url,
                             "--reason", "too slow")  # fmt: skip
    assert out.splitlines() == [f"cancelled 1: {batch[1]}", f"already ended 1: {batch[0]} (done)"]
    code, out, _ = await cli(capsys, "cancel", "--batch", "bx", "--redis", url)
    assert out.splitlines()[0] == f"cancelled 6: {', '.join(batch[2:])}"
    code, _, err = await cli(capsys, "cancel", "--batch", "bx", "--group", "9", "--redis", url)
    assert code == 2 and "has groups 0..3, not 9" in err
    code, _, err = await cli(capsys, "cancel", "--batch", "nope", "--redis", url)
    assert (code, err) == (1, "rollouts cancel: error: no batch 'nope'\n")
    code, out, _ = await cli(capsys, "status", "--redis", url)
    assert "cancelled 8" in out and "done 2" in out
    await client.aclose()
