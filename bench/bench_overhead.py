"""What durable recording costs a worker, measured side by side in one run.

(a) direct:  the engine alone generates the rollouts, at most N in flight;
(b) durable: the same engine, the same rollouts, through a real ``Worker`` (rq queue, per-token
    checkpoints with logprobs, versions and routed experts, AOF ``appendfsync always``);
(c) ceiling: a synthetic engine that yields 16-token chunks with 48-layer x top-8 routes as fast
    as the worker takes them: the bookkeeping ceiling of one worker process.

(a) and (b) alternate for ``--rounds`` rounds; medians are compared. (b)'s greedy tokens are
checked against (a)'s, so the two runs provably did the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from statemachine import Finished, RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.server import RedisServer
from workers.engines.base import Engine, EngineRequest
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig


def requests(n: int, max_tokens: int) -> list[RolloutRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        RolloutRequest(
            prompt_token_ids=tuple(int(t) for t in (np.arange(6) * 7 + 13 * i) % 2000),
            sampling=sampling,
        )
        for i in range(n)
    ]


async def direct(engine: Engine, reqs: list[RolloutRequest], concurrency: int) -> tuple:
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, req: RolloutRequest) -> np.ndarray:
        async with slots:
            ids = [
                c.token_ids
                async for c in engine.generate(
                    EngineRequest(
                        request_id=f"direct-{time.monotonic_ns()}-{i}",
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                    )
                )
            ]
            return np.concatenate(ids)

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return time.perf_counter() - t0, out


async def durable(
    engine: Engine, url: str, reqs: list[RolloutRequest], concurrency: int, queue: str
) -> tuple:
    client = RolloutClient(url, queue_name=queue)
    ids = await client.submit(reqs)
    worker = Worker(
        WorkerConfig(redis_url=url, queues=(queue,), max_concurrency=concurrency, burst=True),
        engine,
    )
    t0 = time.time()
    await worker.run()
    # The end is when the last rollout's Finished was recorded, not when burst mode noticed
    # the empty queue (that waits out one blocking-pop timeout).
    t1 = 0.0
    results = []
    for rid in ids:
        events = await client.store.events(rid)
        t1 = max(t1, *(e.at for e in events if isinstance(e, Finished)))
        results.append((await client.store.load(rid)).token_ids)
    await client.aclose()
    return t1 - t0, results, worker.stats


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        model = args.model
        if model is None:
            from workers.tiny_model import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny-moe", moe=True, seed=0)
        from workers.engines.cpu import CpuEngine

        engine = CpuEngine(model)
        reqs = requests(args.rollouts, args.max_tokens)
        await direct(engine, reqs[:2], 2)  # warm-up: first forwards are slower
        direct_s, durable_s = [], []
        for r in range(args.rounds):
            # Alternate which side goes first: this machine's speed drifts within a run.
            if r % 2:
                w_s, got, _ = await durable(engine, server.url, reqs, args.concurrency, f"q{r}")
                d_s, ref = await direct(engine, reqs, args.concurrency)
            else:
                d_s, ref = await direct(engine, reqs, args.concurrency)
                w_s, got, _ = await durable(engine, server.url, reqs, args.concurrency, f"q{r}")
            assert all(np.array_equal(a, b) for a, b in zip(ref, got)), "durable != direct"
            direct_s.append(d_s)
            durable_s.append(w_s)
        await engine.close()

        tokens = args.rollouts * args.max_tokens
        synth = SyntheticEngine(tokens_per_chunk=16, experts=256, layers=48, top_k=8)
        ceil_reqs = requests(args.ceiling_rollouts, args.ceiling_tokens)
        c_direct_s, _ = await direct(synth, ceil_reqs, args.ceiling_rollouts)
        c_s, _, stats = await durable(synth, server.url, ceil_reqs, args.ceiling_rollouts, "ceil")
        c_tokens = args.ceiling_rollouts * args.ceiling_tokens
    d, w = statistics.median(direct_s), statistics.median(durable_s)
    return {
        "rollouts": args.rollouts,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "direct_s_each": [round(x, 2) for x in direct_s],
        "durable_s_each": [round(x, 2) for x in durable_s],
        "direct_tokens_per_s": round(tokens / d, 1),
        "durable_tokens_per_s": round(tokens / w, 1),
        "ratio": round(d / w, 4),
        "ceiling_tokens_per_s": round(c_tokens / c_s, 1),
        "ceiling_engine_alone_tokens_per_s": round(c_tokens / c_direct_s, 1),
        "ceiling_checkpoints": stats.checkpoints,
        "ceiling_bytes_per_token": 4 + 4 + 8 + 48 * 8,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model dir for the CPU engine (default: tiny MoE)")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ceiling-rollouts", type=int, default=64)
    ap.add_argument("--ceiling-tokens", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps(result) if a.json else "\n".join(f"{k:36s} {v}" for k, v in result.items()))
