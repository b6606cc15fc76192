"""kill -9 a worker mid-rollout: how long until the rollout generates again, and what is lost.

Ours: two worker processes (default lease TTL and heartbeat), one greedy rollout; the worker
generating it is killed with SIGKILL. ``recovery_s`` runs from the kill to the first token
recorded by the resumed attempt: the surviving worker's reaper saw the dead process's presence
subscription vanish with its connections (``store/presence.py``), recorded
``aborted(worker_lost)`` and re-enqueued the rollout, and a worker resumed it. ``--rounds``
kills (a fresh pair of workers each), median reported; ``kill_how`` says how each takeover was
decided (``process_gone``, or ``lease_expired`` if the TTL had come first). ``tokens_regenerated``
estimates what the dead attempt had generated past its last checkpoint: its measured decode
rate times the time between that checkpoint and the kill (bounded by one checkpoint interval).
The kills wait until Redis has been up ``PRESENCE_GRACE_S`` (after a Redis start nobody is
judged gone for that long: every worker is reconnecting); a deployment's Redis has.

A stalled worker (SIGSTOP: alive, connections open) is not gone: ``stop_recovery_s`` is the same
measure for a worker stopped instead of killed, recovered when its lease expires (lease TTL + up
to a reaper interval, as before); it is then continued, and ``stop_fenced`` says that it wrote
nothing of its old attempt after the takeover and is still running.

Baseline, same run, same model and Redis: a plain rq job (``SimpleWorker``, ``Retry(max=1)``)
that generates the whole rollout; its worker is killed the same way and a second one waits.
rq notices the dead execution only when its StartedJobRegistry entry expires (its heartbeat
TTL, at least 60 s) and a worker's maintenance runs, which happens between blocking dequeues
(every 10 min, with dequeues of up to 405 s, by default). The entry's TTL is the job timeout
plus 60 s for a ``SimpleWorker``. Measured here once with defaults and ``job_timeout=600``: not
recovered after 10 minutes. So this run uses rq's best case: ``job_timeout=30`` (TTL 90 s),
``maintenance_interval=5`` and ``worker_ttl=20`` (dequeues of 5 s). rq then retries from scratch:
``rq_recovery_s`` is kill -> first token of the retried execution, ``rq_tokens_regenerated``
what the killed execution had generated. One rq round by default: its figure is its TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from watch import Died, Watch, still_going

from statemachine import (
    Aborted,
    Resumed,
    RolloutRequest,
    SamplingParams,
    Started,
    TokensAppended,
)
from store import defaults
from store.client import RolloutClient
from store.redis_server import RedisServer
from workers import worker_cli

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [101, 7, 350, 12, 999]


def worker(url: str, model: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = worker_cli.command(url, model, name, concurrency=1)
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)


def rq_worker(url: str, log: Path) -> subprocess.Popen[bytes]:
    code = (
        "import sys; sys.path[:0] = [{!r}, {!r}]\n"
        "from redis import Redis; from rq import Queue; from rq.worker import SimpleWorker\n"
        "r = Redis.from_url({!r})\n"
        "SimpleWorker([Queue('baseline', connection=r)], connection=r, worker_ttl=20,"
        " maintenance_interval=5).work(with_scheduler=False)\n"
    ).format(str(ROOT), str(ROOT / "bench"), url)
    env = {**os.environ, "RQBENCH_REDIS": url}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
    )


async def ours(
    server: RedisServer, model: Path, logs: Path, max_tokens: int, kill_at: int, sig: int,
    tag: str,
) -> dict:  # fmt: skip
    """One round: two fresh workers, the one generating the rollout gets ``sig``."""
    url = server.url
    client = RolloutClient(url)
    names = (f"{tag}-a", f"{tag}-b")
    procs = {n: worker(url, model, n, logs / f"{n}.log") for n in names}
    try:
        async with Watch() as watch:
            watch.redis(server)
            for n, p in procs.items():
                watch.process(p, f"worker {n}", logs / f"{n}.log")
            return await _round(client, procs, watch, max_tokens, kill_at, sig)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                p.wait(60)
        await client.aclose()


async def _round(
    client: RolloutClient, procs: dict[str, subprocess.Popen[bytes]], watch: Watch,
    max_tokens: int, kill_at: int, sig: int,
) -> dict:  # fmt: skip
    """``ours`` on its two running workers."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    names = tuple(procs)
    # Both up first: the rollout is killed at `kill_at` tokens, not wherever it got to
    # while the second worker loaded its model.
    await _registered(client, names)
    waited = await _redis_up_for(client, defaults.PRESENCE_GRACE_S)
    request = RolloutRequest(prompt_token_ids=tuple(PROMPT), sampling=sampling)
    [rid] = await client.submit([request])
    while (await client.store.load(rid)).num_tokens < kill_at:
        await still_going(client, rid, f"{kill_at} tokens")
        await asyncio.sleep(0.01)
    victim = next(e.worker_id for e in await client.store.events(rid) if isinstance(e, Started))
    watch.release(procs[victim])  # its end, or its stop, is the point of the round
    procs[victim].send_signal(sig)
    t_kill = time.time()
    if sig == signal.SIGKILL:
        procs[victim].wait()
    while True:
        events = await client.store.events(rid)
        resumed = [e for e in events if isinstance(e, TokensAppended) and e.attempt == 2]
        if resumed:
            break
        await still_going(client, rid, "its next attempt's tokens")
        await asyncio.sleep(0.01)
    if sig == signal.SIGSTOP:
        procs[victim].send_signal(signal.SIGCONT)  # it wakes up and tries to append
    first1 = [e for e in events if isinstance(e, TokensAppended) and e.attempt == 1]
    rate = (first1[-1].offset + len(first1[-1]) - first1[0].offset - len(first1[0])) / max(
        1e-9, first1[-1].at - first1[0].at
    )
    regenerated = rate * max(0.0, t_kill - first1[-1].at)
    await client.wait([rid], timeout=600)
    events = await client.store.events(rid)
    [lost] = [e for e in events if isinstance(e, Aborted)]
    fenced = all(getattr(e, "attempt", 1) != 1 or e.seq <= lost.seq for e in events)
    began = next(e for e in events if isinstance(e, Resumed))
    return {
        "recovery_s": resumed[0].at - t_kill,
        # Where it goes: kill -> abort recorded -> next attempt opened -> its first tokens.
        "detect_s": lost.at - t_kill,
        "reopen_s": began.at - lost.at,
        "first_tokens_s": resumed[0].at - began.at,
        "how": "process_gone" if "gone" in lost.detail else "lease_expired",
        "tokens_regenerated": regenerated,
        "persisted_at_kill": resumed[0].offset,
        "decode_tokens_per_s": rate,
        "waited_for_grace_s": waited,
        "fenced": fenced and procs[victim].poll() is None,
    }


async def _registered(client: RolloutClient, names: tuple[str, ...]) -> None:
    """Until both workers hold their presence (a worker that just started is not watched)."""
    want = {n.encode() for n in names}
    while not want <= set(await client.store.redis.hkeys(client.store.keys.presence())):
        await asyncio.sleep(0.05)


async def _redis_up_for(client: RolloutClient, seconds: float) -> float:
    t0 = time.monotonic()
    while int((await client.store.redis.info("server"))["uptime_in_seconds"]) < seconds:
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def baseline(server: RedisServer, model: Path, logs: Path, max_tokens: int, kill_at: int) -> dict:
    from rq_baseline_job import PROGRESS

    url = server.url
    r = Redis.from_url(url)
    r.delete(PROGRESS)  # executions are counted from 1 in each round
    q = Queue("baseline", connection=r)
    job = q.enqueue(
        "rq_baseline_job.generate",
        str(model),
        PROMPT,
        max_tokens,
        retry=Retry(max=1),
        job_timeout=30,
    )
    watch = Watch()  # synchronous: checked in the waiting loops
    watch.redis(server)
    a = watch.process(rq_worker(url, logs / "rq-a.log"), "rq worker a", logs / "rq-a.log")
    b = None
    try:
        while int(r.hget(PROGRESS, "1") or 0) < kill_at:
            _still_running(watch, job)
            time.sleep(0.01)
        watch.release(a)
        a.send_signal(signal.SIGKILL)
        t_kill = time.time()
        a.wait()
        lost = int(r.hget(PROGRESS, "1") or 0)
        b = watch.process(rq_worker(url, logs / "rq-b.log"), "rq worker b", logs / "rq-b.log")
        while int(r.hget(PROGRESS, "2") or 0) < 1:
            _still_running(watch, job)
            time.sleep(0.05)
        return {"rq_recovery_s": time.time() - t_kill, "rq_tokens_regenerated": lost}
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(60)


def _still_running(watch: Watch, job: Job) -> None:
    """Neither worker process nor Redis is gone, and the job did not fail: an rq worker whose
    job raised lives on, waiting for the next job, and so would this benchmark."""
    watch.check()
    if job.get_status(refresh=True) == JobStatus.FAILED:
        result = job.latest_result()
        raise Died(f"the rq job failed: {result.exc_string if result else '(no result)'}")


def main(args: argparse.Namespace) -> dict:
    from workers.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        model = args.model or make_tiny_model(Path(tmp) / "dense", moe=False, seed=0)
        run = lambda sig, tag: asyncio.run(  # noqa: E731
            ours(server, model, Path(tmp), args.max_tokens, args.kill_at, sig, tag)
        )
        kills = [run(signal.SIGKILL, f"kill{i}") for i in range(args.rounds)]
        stops = [run(signal.SIGSTOP, f"stop{i}") for i in range(args.stop_rounds)]
        base = [
            baseline(server, model, Path(tmp), args.max_tokens, args.kill_at)
            for _ in range(args.rq_rounds)
        ]
        numsub = _commandstat(server.url, "cmdstat_pubsub|numsub")
    recovery = median(k["recovery_s"] for k in kills)
    rq_recovery = _median([b["rq_recovery_s"] for b in base], 3)
    return {
        "recovery_s": round(recovery, 3),
        "recovery_s_max": round(max(k["recovery_s"] for k in kills), 3),
        "kill_rounds": len(kills),
        "kill_how": [k["how"] for k in kills],
        "detect_s": round(median(k["detect_s"] for k in kills), 3),
        "reopen_s": round(median(k["reopen_s"] for k in kills), 3),
        "first_tokens_s": round(median(k["first_tokens_s"] for k in kills), 3),
        "tokens_regenerated": round(median(k["tokens_regenerated"] for k in kills), 1),
        # None where a part did not run (--rq-rounds 0, --stop-rounds 0).
        "rq_recovery_s": rq_recovery,
        "rq_tokens_regenerated": _median([b["rq_tokens_regenerated"] for b in base], 1),
        "speedup": None if rq_recovery is None else round(rq_recovery / recovery, 1),
        "stop_recovery_s": _median([s["recovery_s"] for s in stops], 3),
        "stop_how": [s["how"] for s in stops],
        "stop_fenced": all(s["fenced"] for s in stops),
        "persisted_at_kill": kills[0]["persisted_at_kill"],
        "decode_tokens_per_s": round(median(k["decode_tokens_per_s"] for k in kills), 1),
        "waited_for_grace_s": round(sum(k["waited_for_grace_s"] for k in kills + stops), 1),
        "presence_numsub_calls": numsub.get("calls", 0),
        "presence_numsub_usec_per_call": numsub.get("usec_per_call", 0.0),
        "lease_ttl_s": defaults.LEASE_TTL_S,
        "presence_check_s": defaults.PRESENCE_CHECK_S,
        # A worker's absence is confirmed over RTT_FACTOR of its round trips, within these.
        "presence_confirm_s": [defaults.PRESENCE_CONFIRM_MIN_S, defaults.PRESENCE_CONFIRM_S],
        "presence_rtt_factor": defaults.PRESENCE_RTT_FACTOR,
        "rq_maintenance_interval_s": 5,
        "rq_worker_ttl_s": 20,
        "rq_job_timeout_s": 30,
    }


def _median(values: list[float], places: int) -> float | None:
    return round(median(values), places) if values else None


def _commandstat(url: str, name: str) -> dict:
    """What Redis counted for one command over the whole run (calls, usec per call)."""
    stats = Redis.from_url(url).info("commandstats")
    return dict(stats.get(name.removeprefix("cmdstat_"), stats.get(name, {})))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--kill-at", type=int, default=200, help="tokens generated before the kill")
    ap.add_argument("--rounds", type=int, default=5, help="kill -9 rounds (median reported)")
    ap.add_argument("--stop-rounds", type=int, default=1, help="SIGSTOP rounds")
    ap.add_argument("--rq-rounds", type=int, default=1, help="plain rq rounds (~95 s each)")
    ap.add_argument("--model", type=Path, help="HF model dir for the workers (default: tiny dense)")
    ap.add_argument(
        "--quick", action="store_true",
        help="a tiny workload (the smoke test's): one kill round, no stop or rq round",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    if ns.quick:
        ns.max_tokens, ns.kill_at, ns.rounds, ns.stop_rounds, ns.rq_rounds = 400, 100, 1, 0, 0
    out = main(ns)
    print(json.dumps(out) if ns.json else "\n".join(f"{k:28s} {v}" for k, v in out.items()))
