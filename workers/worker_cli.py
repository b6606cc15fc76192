"""``rollouts worker``: run one worker process until SIGTERM/SIGINT (or, with --burst, until
the queues are empty)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from store import defaults, queue_redis, redis_options
from store.connection import DEFAULT_URL, redact
from store.errors import InvalidRedisUrl
from store.logs import add_log_format, log_event
from store.logs import configure as configure_logs
from workers.checkpoint import Cadence
from workers.die_with_parent import ask_children_to_die_with_me
from workers.engine_factory import (
    ENGINES,
    SYNTHETIC_ARGS_ENV,
    VLLM_ARGS_ENV,
    VLLM_SERVERS_ENV,
    make_engine,
)
from workers.metrics import WorkerMetrics
from workers.weight_updates import WeightMode
from workers.worker import Worker, WorkerConfig

log = logging.getLogger("rollouts.worker")


def command(
    redis_url: str | None,
    model: str | Path,
    name: str,
    *extra: str,
    concurrency: int = 2,
    engine: str = "cpu",
) -> list[str]:
    """The command line of a worker process (for the demo, tests and benchmarks). With
    ``redis_url`` None the worker takes its URL from ``$ROLLOUTS_REDIS_URL`` (no password in
    `ps`)."""
    return [
        sys.executable,
        "-m",
        "workers.cli",
        "worker",
        *(["--redis", redis_url] if redis_url is not None else []),
        "--engine",
        engine,
        "--model",
        str(model),
        "--max-concurrency",
        str(concurrency),
        "--name",
        name,
        *extra,
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    redis_options.add_arguments(parser, otherwise=DEFAULT_URL)
    queue_redis.add_argument(parser)
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="cpu",
        help="cpu (transformers), vllm (in-process AsyncLLM; its arguments as JSON in "
        f"${VLLM_ARGS_ENV}), vllm-http (servers listed in ${VLLM_SERVERS_ENV}) or synthetic "
        f"(no model, for tests and benchmarks; its options as JSON in ${SYNTHETIC_ARGS_ENV}) "
        "(default cpu)",
    )
    parser.add_argument(
        "--model", help="model directory (HF layout) for the cpu and vllm engines (default: none)"
    )
    parser.add_argument(
        "--max-concurrency",
        type=_at_least(1),
        default=4,
        help="rollouts generating at once on this engine (default 4)",
    )
    parser.add_argument(
        "--queue",
        action="append",
        dest="queues",
        help=f"rq queue to take work from (repeatable; default {defaults.QUEUE_NAME})",
    )
    parser.add_argument(
        "--name",
        help="worker name, in its attempts, stats, logs and metrics (default host.pid.random)",
    )
    parser.add_argument(
        "--checkpoint-tokens",
        type=int,
        default=defaults.CHECKPOINT_TOKENS,
        help="save a rollout's progress once it has this many unsaved tokens (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        default=defaults.CHECKPOINT_INTERVAL_S,
        help="... or once this many seconds passed since the last save (default %(default)s)",
    )
    parser.add_argument(
        "--prefetch-tokens",
        type=_at_least(0),
        default=defaults.PREFETCH_TOKENS,
        help="take the next job when a rollout has this many tokens left, so that its start "
        "(dequeue, lease, Started) overlaps that rollout's last engine steps; the engine never "
        "holds more than --max-concurrency requests; 0: when it ends (default %(default)s)",
    )
    parser.add_argument(
        "--max-engine-attempts",
        type=int,
        default=defaults.MAX_ENGINE_ATTEMPTS,
        help="attempts of a rollout the engine may fail on before the rollout is failed as "
        "engine_error (default %(default)s)",
    )
    parser.add_argument(
        "--max-worker-lost",
        type=int,
        default=defaults.MAX_WORKER_LOST,
        help="workers that may die under one rollout (its lease lapsed, or it was taken over) "
        "before it is failed as worker_lost, so that a prompt that kills every worker it lands "
        f"on (e.g. out of memory) cannot take down the fleet forever (default "
        f"{defaults.MAX_WORKER_LOST})",
    )
    redis_options.add_min_replicas_acked(
        parser, "a checkpoint", "the worker retries it, its tokens kept"
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=defaults.LEASE_TTL_S,
        help="seconds a rollout stays leased without a heartbeat before another worker takes it "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=defaults.HEARTBEAT_S,
        help="seconds between lease renewals, stats heartbeats and metric refreshes "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--engine-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="consume the engine's steps for all its requests at once (workers/stepper.py) "
        "where the engine offers them (synthetic, cpu, vllm in-process); --no-engine-steps: "
        "one stream per rollout, as before (at 256 rollouts in flight the steps take 2-4x "
        "the tokens per second of one worker, measured by bench_overhead's gpu_cadence) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--burst", action="store_true", help="exit when the queues are empty (default: off)"
    )
    parser.add_argument(
        "--weight-mode",
        choices=[m.value for m in WeightMode],
        default=WeightMode.ABORT.value,
        help="on a new weight version: abort in-flight rollouts and resume them on the new "
        "weights, drain them on the old ones first, or keep them in flight "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--weight-version",
        type=int,
        default=0,
        help="version of the weights the engine starts with (default 0)",
    )
    parser.add_argument(
        "--model-id",
        help="the model identity every attempt records; a rollout is only resumed on the "
        "model its earlier attempts ran (default: from the model directory's config.json; "
        "name it for vllm-http without --model)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics are served on; 0.0.0.0 for a scraper on another host "
        "(default %(default)s)",
    )
    add_log_format(parser)


def run(args: argparse.Namespace) -> int:
    configure_logs(args.log_format)
    # Redis first: loading an engine takes minutes (vLLM), a wrong password a moment.
    try:
        redis_url = redis_options.resolve(args) or DEFAULT_URL
    except InvalidRedisUrl as exc:
        # Its message names the file and never the URL.
        return _refuse(str(exc))
    try:
        queue_url = queue_redis.resolve(redis_url, args.queue_redis)
    except InvalidRedisUrl as exc:
        return _refuse(str(exc))
    problem = redis_options.check_each(redis_url, queue_url)
    if problem is not None:
        return _refuse(problem)
    log.info("Redis at %s", redact(redis_url))
    if queue_url != redis_url:
        log.info("rq's queue on Redis at %s", redact(queue_url))
    # Before the engine (minutes for vLLM): a port already taken is known at once.
    metrics = WorkerMetrics(engine=args.engine)
    if args.metrics_port is not None:
        try:
            port = metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as exc:
            return _refuse(
                f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}"
            )
        log_event(
            log, logging.INFO, "metrics",
            f"Prometheus metrics at http://{args.metrics_host}:{port}/metrics",
            host=args.metrics_host, port=port,
        )  # fmt: skip
    if args.engine == "vllm":
        # vLLM's engine processes must not outlive this one (SIGKILL included).
        ask_children_to_die_with_me()
    engine = make_engine(args.engine, args.model, weight_version=args.weight_version)
    extra = {"name": args.name} if args.name else {}
    config = WorkerConfig(
        redis_url=redis_url,
        queues=tuple(args.queues or (defaults.QUEUE_NAME,)),
        max_concurrency=args.max_concurrency,
        cadence=Cadence(tokens=args.checkpoint_tokens, interval_s=args.checkpoint_interval),
        prefetch_tokens=args.prefetch_tokens,
        max_engine_attempts=args.max_engine_attempts,
        max_worker_lost=args.max_worker_lost,
        burst=args.burst,
        weight_mode=WeightMode(args.weight_mode),
        lease_ttl_s=args.lease_ttl,
        heartbeat_s=args.heartbeat,
        model_id=args.model_id,
        stepped=None if args.engine_steps else False,
        min_replicas_acked=args.min_replicas_acked,
        queue_url=queue_url,
        **extra,
    )
    worker = Worker(config, engine, metrics)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        try:
            stats = await worker.run()
        finally:
            await engine.close()
        print(
            json.dumps(
                {
                    "worker": config.name,
                    "tokens": stats.tokens,
                    "checkpoints": stats.checkpoints,
                    "nonfinite_logprobs": stats.nonfinite_logprobs,
                    "outcomes": stats.outcomes,
                    "engine_dead": stats.engine_dead,
                }
            ),
            flush=True,
        )

    try:
        asyncio.run(main())
    finally:
        metrics.close()
    # Non-zero when the engine died, so a supervisor restarts the worker (with a new engine).
    return 1 if worker.stats.engine_dead else 0


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number, ``low`` or more (refused with a usage error, exit 2,
    instead of a traceback from the worker's own check)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number is needed, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number 0-65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), got {port}")
    return port


def _refuse(message: str) -> int:
    """One line on stderr and exit code 2 (a usage/configuration error, as argparse's): no
    traceback, and no restart by a supervisor will fix it."""
    print(f"rollouts worker: error: {message}", file=sys.stderr, flush=True)
    return 2
