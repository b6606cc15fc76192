"""kill -9 a worker mid-rollout: how long until the rollout generates again, and what is lost.

Ours: two worker processes (default lease TTL and heartbeat), one greedy rollout; the worker
generating it is killed with SIGKILL. ``recovery_s`` runs from the kill to the first token
recorded by the resumed attempt (the reaper of the surviving worker turned the expired lease
into ``aborted(worker_lost)`` and re-enqueued it). ``tokens_regenerated`` estimates what the dead
attempt had generated past its last checkpoint: its measured decode rate times the time
between that checkpoint and the kill (bounded by one checkpoint interval by design).

Baseline, same run, same model and Redis: a plain rq job (``SimpleWorker``, ``Retry(max=1)``)
that generates the whole rollout; its worker is killed the same way and a second one waits.
rq notices the dead execution only when its StartedJobRegistry entry expires (its heartbeat
TTL, at least 60 s) and a worker's maintenance runs, which happens between blocking dequeues
(every 10 min, with dequeues of up to 405 s, by default). The entry's TTL is the job timeout
plus 60 s for a ``SimpleWorker``. Measured here once with defaults and ``job_timeout=600``: not
recovered after 10 minutes. So this run uses rq's best case: ``job_timeout=30`` (TTL 90 s),
``maintenance_interval=5`` and ``worker_ttl=20`` (dequeues of 5 s). rq then retries from scratch:
``rq_recovery_s`` is kill -> first token of the retried execution, ``rq_tokens_regenerated``
what the killed execution had generated.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis import Redis
from rq import Queue, Retry

from statemachine import RolloutRequest, SamplingParams, Started, TokensAppended
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


async def ours(url: str, model: Path, logs: Path, max_tokens: int, kill_at: int) -> dict:
    client = RolloutClient(url)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=tuple(PROMPT), sampling=sampling)])
    procs = {n: worker(url, model, n, logs / f"{n}.log") for n in ("ours-a", "ours-b")}
    try:
        while (await client.store.load(rid)).num_tokens < kill_at:
            await asyncio.sleep(0.01)
        victim = next(e.worker_id for e in await client.store.events(rid) if isinstance(e, Started))
        procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.time()
        procs[victim].wait()
        while True:
            events = await client.store.events(rid)
            resumed = [e for e in events if isinstance(e, TokensAppended) and e.attempt == 2]
            if resumed:
                break
            await asyncio.sleep(0.01)
        first1 = [e for e in events if isinstance(e, TokensAppended) and e.attempt == 1]
        rate = (first1[-1].offset + len(first1[-1]) - first1[0].offset - len(first1[0])) / max(
            1e-9, first1[-1].at - first1[0].at
        )
        regenerated = rate * max(0.0, t_kill - first1[-1].at)
        await client.wait([rid], timeout=600)
        return {
            "recovery_s": resumed[0].at - t_kill,
            "tokens_regenerated": regenerated,
            "persisted_at_kill": resumed[0].offset,
            "decode_tokens_per_s": rate,
        }
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        await client.aclose()


def baseline(url: str, model: Path, logs: Path, max_tokens: int, kill_at: int) -> dict:
    from rq_baseline_job import PROGRESS

    r = Redis.from_url(url)
    q = Queue("baseline", connection=r)
    q.enqueue(
        "rq_baseline_job.generate",
        str(model),
        PROMPT,
        max_tokens,
        retry=Retry(max=1),
        job_timeout=30,
    )
    a = rq_worker(url, logs / "rq-a.log")
    b = None
    try:
        while int(r.hget(PROGRESS, "1") or 0) < kill_at:
            time.sleep(0.01)
        a.send_signal(signal.SIGKILL)
        t_kill = time.time()
        a.wait()
        lost = int(r.hget(PROGRESS, "1") or 0)
        b = rq_worker(url, logs / "rq-b.log")
        while int(r.hget(PROGRESS, "2") or 0) < 1:
            time.sleep(0.05)
        return {"rq_recovery_s": time.time() - t_kill, "rq_tokens_regenerated": lost}
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(60)


def main(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from workers.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        model = make_tiny_model(Path(tmp) / "dense", moe=False, seed=0)
        mine = asyncio.run(ours(server.url, model, Path(tmp), args.max_tokens, args.kill_at))
        base = baseline(server.url, model, Path(tmp), args.max_tokens, args.kill_at)
    return {
        "recovery_s": round(mine["recovery_s"], 3),
        "tokens_regenerated": round(mine["tokens_regenerated"], 1),
        "rq_recovery_s": round(base["rq_recovery_s"], 3),
        "rq_tokens_regenerated": base["rq_tokens_regenerated"],
        "speedup": round(base["rq_recovery_s"] / mine["recovery_s"], 1),
        "persisted_at_kill": mine["persisted_at_kill"],
        "decode_tokens_per_s": round(mine["decode_tokens_per_s"], 1),
        "lease_ttl_s": 5.0,
        "rq_maintenance_interval_s": 5,
        "rq_worker_ttl_s": 20,
        "rq_job_timeout_s": 30,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--kill-at", type=int, default=200, help="tokens generated before the kill")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    out = main(ns)
    print(json.dumps(out) if ns.json else "\n".join(f"{k:28s} {v}" for k, v in out.items()))
