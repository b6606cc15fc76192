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

(d) gpu_cadence: what a GPU node asks of one worker. vLLM streams one token per request per
    engine step for hundreds of requests; the synthetic engine does the same (1-token chunks,
    48-layer x top-8 routes, 512-token rollouts, AOF always) with 256 and then 1,024 rollouts
    in flight. Engine alone vs through one burst-mode worker, both through the engine's whole
    steps (``StepEngine``, what the worker's stepper consumes), in ``--gpu-rounds``
    alternating pairs; the figures are medians. ``gpu_cadence_added_cpu_us_per_token`` is the
    CPU this process (the worker's) spent per token while the worker ran, minus what the
    engine alone spent per token: the rollouts are submitted before and read back after.
    ``--gpu-interface generate`` measures the per-rollout streams instead (the design before
    the stepper).

Where the worker's time per token goes at GPU cadence (py-spy --gil, 256 rollouts x 512
tokens, one burst worker; shares of the samples holding the GIL). Before the stepper, per
rollout streams: the engine's async generator 31%, the event loop's scheduling of one task step
per token per rollout 25%, joining 1-token chunks into checkpoints 12%, the runner's chunk loop
and flush-point checks 5%: ~70% per token per rollout; checkpoint appends ~9%, rq ~5%. With
the stepper: the engine's steps 10%, scattering them into rows and building checkpoints 13%,
the checkpoint appends themselves (the store's prepare, encode and redis-py packing: 170-210
us of CPU per 16-token checkpoint with 48x8 routes, ~11-13 us per token, measured alone)
~30%, and the per-rollout path (rq's dequeue, start and success bookkeeping in its threads,
the runner's load, lease and first/last events) most of the rest.

That profile hid the real limit: the worker took one rq job per dequeue, and each dequeue cost
~20 ms while the event loop was busy (two thread hops, and after each reply a GIL wait of up to
the 5 ms switch interval), so with 256 slots it never ran more than ~14 rollouts (measured: 4-5
requests per engine step on average, against 256 for the engine alone). Steps that small made
every per-step cost a per-token one. Taking all queued jobs it has slots for in one dequeue
(``RqBridge.dequeue_many``) fills the slots in a fraction of a second: 150-190 requests per
step, 55k -> 128k-171k tokens/s at 256 in flight and 105k-166k at 1,024, and the worker's
added CPU 19 -> 9-10 us per token (12 at 1,024).

What was left then was mostly per rollout (~5 ms of CPU per 512-token rollout): py-spy --gil
put rq's success
bookkeeping (~7 round trips per job on the books thread) at a fifth of the worker's samples, and
each rollout's own first load, lease take and lease drop made redis-py's asyncio pool open one
connection per rollout running them at once (72 connections for 64 rollouts, measured), each
parsing redis-py's package metadata for CLIENT SETINFO (~1 ms). Now those calls go together
(``store.coalesce.Coalescer``: the calls made while a batch is in flight form the next one;
``RqBridge._record_successes``: two round trips per batch of successes), the driver info is
resolved once, the stuck-dequeue sweep is pipelined, and the stepper's rows grow without zeroing
token data (~25 MB per doubling at 256 rows with 48x8 routes), and a transaction's QUEUED
replies are read under one deadline (redis-py opened an asyncio timeout per reply: 6.9 -> 1.2-1.9
us of client CPU per queued command). Added CPU per token: 9.8 -> 3.9-5.8 at 256 in flight
(median of ten runs 4.5) and 3.8-4.4 at 1,024; 177k-274k tokens/s through the worker.

Then (py-spy --gil, same run, shares of the worker's samples): the stepper 24% (scattering steps
into rows 4%, cutting rows into checkpoint events 18%), the checkpoint appends 20% (the store's
prepare 13%, of which encoding 6% and the transition 3%; the transaction 7%), rq's bookkeeping
on its thread 20% (successes 9%, starts 6%), the runner's per-rollout path 13%, socket reads
5%. Since: records are checksummed with zlib-ng's CRC-32 (zlib's values at ~15x the speed) and
packed without a conversion call, which halves a chunk's encoding; a record's XADD goes ahead of
the script instead of through a RENAME gate (one command per record instead of three); rq's
serializer check is answered once per serializer instead of five times per job (~13 us each).
Added CPU per token 3.6 at 256 in flight in a full run, 4.3-4.8 in side runs. Per rollout a
worker still spends ~1 ms of CPU (16-token rollouts, 64 in flight): rq's bookkeeping on its
thread is ~40% of it, half of that redis-py's own pipeline code (~70 us per job for the 15
commands of a success, ~37 us packed by hiredis and read raw, measured alone).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import burst, compare, direct, direct_steps, durable, requests
from watch import Watch

from store.redis_server import RedisServer
from workers.engines.synthetic import SyntheticEngine

# --quick: a tiny workload of every part, for the smoke test (tests/bench/test_bench_overhead.py).
QUICK = {
    "rollouts": 4, "max_tokens": 16, "short_tokens": 8, "rounds": 2, "ceiling_rollouts": 4,
    "ceiling_tokens": 64, "gpu_in_flight": [16], "gpu_tokens": 16, "gpu_rounds": 1,
}  # fmt: skip


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        out: dict = {}
        async with Watch() as watch:
            watch.redis(server)
            if not args.skip_cpu_engine:
                out.update(await cpu_engine(server, Path(tmp), args))
                out.update(await ceiling(server, args))
            for in_flight in args.gpu_in_flight:
                figures = await gpu_cadence(server, in_flight, args)
                prefix = "gpu_cadence" if in_flight == 256 else f"gpu_cadence_{in_flight}"
                out.update({f"{prefix}_{k}": v for k, v in figures.items()})
    return out


async def cpu_engine(server: RedisServer, tmp: Path, args: argparse.Namespace) -> dict:
    """(a) and (b) of the module docstring, on the CPU engine."""
    model = args.model
    if model is None:
        from workers.demo.tiny_model import make_tiny_model

        model = make_tiny_model(tmp / "tiny-moe", moe=True, seed=0)
    from workers.engines.cpu.engine import CpuEngine

    engine = CpuEngine(model)
    try:
        reqs = requests(args.rollouts, args.max_tokens)
        await direct(engine, reqs[:2], 2)  # warm-up: first forwards are slower
        side = await compare(engine, server.url, reqs, args.concurrency, args.rounds)
        short = None
        if args.short_tokens:
            short_reqs = requests(args.rollouts, args.short_tokens)
            short = await compare(engine, server.url, short_reqs, args.concurrency, args.rounds)
    finally:
        await engine.close()
    tokens = args.rollouts * args.max_tokens
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
    }


async def ceiling(server: RedisServer, args: argparse.Namespace) -> dict:
    """(c) of the module docstring: the worker as it runs (on the stepper: the synthetic
    engine offers steps) vs the engine alone through `generate`."""
    synth = SyntheticEngine(tokens_per_chunk=16, experts=256, layers=48, top_k=8)
    ceil_reqs = requests(args.ceiling_rollouts, args.ceiling_tokens)
    c_direct_s, _ = await direct(synth, ceil_reqs, args.ceiling_rollouts)
    c_s, _, stats = await durable(synth, server.url, ceil_reqs, args.ceiling_rollouts, "ceil")
    c_tokens = args.ceiling_rollouts * args.ceiling_tokens
    return {
        "ceiling_tokens_per_s": round(c_tokens / c_s, 1),
        "ceiling_engine_alone_tokens_per_s": round(c_tokens / c_direct_s, 1),
        "ceiling_checkpoints": stats.checkpoints,
        "ceiling_bytes_per_token": 4 + 4 + 8 + 48 * 8,
    }


async def gpu_cadence(server: RedisServer, in_flight: int, args: argparse.Namespace) -> dict:
    """(d) of the module docstring, for one number of rollouts in flight."""
    engine = SyntheticEngine(tokens_per_chunk=1, experts=256, layers=48, top_k=8)
    reqs = requests(in_flight, args.gpu_tokens)
    tokens = in_flight * args.gpu_tokens
    stepped = args.gpu_interface == "steps"
    redis_pid = server.proc.pid if server.proc else None
    alone_s, alone_cpu, worker_s, worker_cpu, redis_cpu, pairs, trips = [], [], [], [], [], [], []
    for r in range(args.gpu_rounds):
        order = ("alone", "worker") if r % 4 in (0, 3) else ("worker", "alone")
        for side in order:
            if side == "alone":
                if stepped:
                    seconds, ref, cpu = await direct_steps(engine, reqs, in_flight)
                else:
                    c0 = _cpu()
                    seconds, ref = await direct(engine, reqs, in_flight)
                    cpu = _cpu() - c0
                alone_s.append(seconds)
                alone_cpu.append(cpu)
            else:
                run = await burst(
                    engine, server.url, reqs, in_flight, f"gpu-{in_flight}-{r}",
                    stepped=stepped, redis_pid=redis_pid,
                )  # fmt: skip
                got = run.token_ids
                worker_s.append(run.seconds)
                worker_cpu.append(run.cpu_s)
                redis_cpu.append(run.redis_cpu_s)
                trips.append(run.round_trips)
        pairs.append(alone_s[-1] / worker_s[-1])
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), "worker != alone"
    us = 1e6 / tokens
    return {
        "in_flight": in_flight,
        "tokens_per_rollout": args.gpu_tokens,
        "interface": args.gpu_interface,
        "engine_alone_tokens_per_s": round(tokens / statistics.median(alone_s), 1),
        "tokens_per_s": round(tokens / statistics.median(worker_s), 1),
        "ratio": round(statistics.median(pairs), 4),
        "ratio_each": [round(x, 3) for x in pairs],
        "engine_alone_cpu_us_per_token": round(statistics.median(alone_cpu) * us, 3),
        "worker_cpu_us_per_token": round(statistics.median(worker_cpu) * us, 3),
        "added_cpu_us_per_token": round(
            (statistics.median(worker_cpu) - statistics.median(alone_cpu)) * us, 3
        ),
        "redis_cpu_us_per_token": round(statistics.median(redis_cpu) * us, 3),
        "round_trips_each": trips,
    }


def _cpu() -> float:
    return time.process_time()


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
    ap.add_argument(
        "--gpu-in-flight", type=int, nargs="*", default=[256, 1024],
        help="rollouts in flight for the GPU-cadence figures (none: skip them)",
    )  # fmt: skip
    ap.add_argument("--gpu-tokens", type=int, default=512, help="tokens per GPU-cadence rollout")
    ap.add_argument("--gpu-rounds", type=int, default=4)
    ap.add_argument("--gpu-interface", choices=("steps", "generate"), default="steps")
    ap.add_argument(
        "--skip-cpu-engine", action="store_true",
        help="only the synthetic-engine figures (ceiling, GPU cadence): no tiny model, no torch",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.quick:
        vars(a).update(QUICK)
    result = asyncio.run(main(a))
    print(json.dumps(result) if a.json else "\n".join(f"{k:36s} {v}" for k, v in result.items()))
