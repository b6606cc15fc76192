"""What durable recording costs a worker, measured side by side in one run.

(a) direct:  the engine alone generates the rollouts, at most N in flight;
(b) durable: the same engine, the same rollouts, through a real ``Worker`` (rq queue, per-token
    checkpoints with logprobs, versions and routed experts, AOF ``appendfsync always``);
(c) ceiling: a synthetic engine that yields 16-token chunks with 48-layer x top-8 routes as fast
    as the worker takes them: the bookkeeping ceiling of one worker process.

The CPU engine's model runs in a process of its own (``workers/engines/cpu/process.py``), as
vLLM's engine core does, so (b)'s bookkeeping runs beside decoding, not between its steps.

(a) and (b) run as ``--rounds`` back-to-back pairs on one resident worker; ``ratio`` is the
median of the pairs' ratios (why: side_by_side.py). (b)'s greedy tokens are checked against
(a)'s, so the two runs provably did the same work.

Two workloads, because durable recording has two kinds of cost. Per token: the checkpoints
(one Redis round trip per flush point for all the worker's rollouts). Per rollout: taking the
rq job, the lease, Started, Finished, rq's success bookkeeping (~14 round trips). The main
figures use 256-token rollouts (RL responses are longer still, so this is the conservative
end); ``short_*`` repeats the comparison with 32-token rollouts, where the per-rollout cost
is spread over 8x fewer tokens and shows. On this 2-core machine any work beside the engine
slows it: a busy loop on the other core costs it ~7%, measured, even with the engine pinned
to a core of its own; so everything the worker does per rollout shows up in these ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import compare, direct, durable, requests

from store.redis_server import RedisServer
from workers.engines.synthetic import SyntheticEngine


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        model = args.model
        if model is None:
            from workers.tiny_model import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny-moe", moe=True, seed=0)
        from workers.engines.cpu.engine import CpuEngine

        engine = CpuEngine(model)
        reqs = requests(args.rollouts, args.max_tokens)
        await direct(engine, reqs[:2], 2)  # warm-up: first forwards are slower
        side = await compare(engine, server.url, reqs, args.concurrency, args.rounds)
        short = None
        if args.short_tokens:
            short_reqs = requests(args.rollouts, args.short_tokens)
            short = await compare(engine, server.url, short_reqs, args.concurrency, args.rounds)
        await engine.close()

        tokens = args.rollouts * args.max_tokens
        synth = SyntheticEngine(tokens_per_chunk=16, experts=256, layers=48, top_k=8)
        ceil_reqs = requests(args.ceiling_rollouts, args.ceiling_tokens)
        c_direct_s, _ = await direct(synth, ceil_reqs, args.ceiling_rollouts)
        c_s, _, stats = await durable(synth, server.url, ceil_reqs, args.ceiling_rollouts, "ceil")
        c_tokens = args.ceiling_rollouts * args.ceiling_tokens
    return {
        "rollouts": args.rollouts,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        **side.figures(tokens),
        **(
            {}
            if short is None
            else {
                "short_max_tokens": args.short_tokens,
                **{
                    f"short_{k}": v
                    for k, v in short.figures(args.rollouts * args.short_tokens).items()
                    if not k.endswith("_each")
                },
            }
        ),
        "ceiling_tokens_per_s": round(c_tokens / c_s, 1),
        "ceiling_engine_alone_tokens_per_s": round(c_tokens / c_direct_s, 1),
        "ceiling_checkpoints": stats.checkpoints,
        "ceiling_bytes_per_token": 4 + 4 + 8 + 48 * 8,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model dir for the CPU engine (default: tiny MoE)")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--short-tokens", type=int, default=32, help="0: skip the short workload")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ceiling-rollouts", type=int, default=64)
    ap.add_argument("--ceiling-tokens", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps(result) if a.json else "\n".join(f"{k:36s} {v}" for k, v in result.items()))
