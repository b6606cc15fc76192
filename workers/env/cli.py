"""``rollouts env``: serve registered Python tools for the episodes of one or more environment
queues until SIGTERM/SIGINT (running calls finish within ``--grace-s``, then exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable

from statemachine.episode import DEFAULT_ENV_QUEUE
from store import EventStore, defaults, queue_redis, redis_options
from store.connection import DEFAULT_URL, connect, connect_sync, redact
from store.environment import EnvironmentClient
from store.errors import InvalidRedisUrl, InvalidRolloutId
from store.keys import check_batch_id
from store.logs import add_log_format
from store.logs import configure as configure_logs
from store.slots import is_cluster_url
from workers.env.runner import DEFAULT_GRACE_S, EnvRunner, RunnerConfig
from workers.env.tools import load_tools

log = logging.getLogger("rollouts.env")


def command(
    redis_url: str | None, *extra: str, tools: str = "examples.calculator:calculator"
) -> list[str]:
    """The command line of a runner process serving ``tools`` (for tests and the demo)."""
    redis = ["--redis", redis_url] if redis_url is not None else []
    return [sys.executable, "-m", "workers.cli", "env", *redis, "--tools", tools, *extra]


def configure(parser: argparse.ArgumentParser) -> None:
    redis_options.add_arguments(parser, otherwise=DEFAULT_URL)
    queue_redis.add_argument(parser)  # where a tool result's next turn's job goes
    parser.add_argument(
        "--tools",
        action="append",
        required=True,
        metavar="MODULE:ATTR",
        help="tools to serve (repeatable): ATTR is a callable, served under its __name__, or a "
        "mapping name -> callable; MODULE is imported with the working directory first on the "
        "path (e.g. examples.calculator:calculator) (required)",
    )
    parser.add_argument(
        "--queue",
        action="append",
        dest="queues",
        type=_queue,
        metavar="NAME",
        help="environment queue to claim calls from, an episode's env_queue (repeatable; "
        f"default {DEFAULT_ENV_QUEUE})",
    )
    parser.add_argument(
        "--runner-id",
        metavar="ID",
        help="this runner's name, recorded with each claim and in its logs (default host:pid)",
    )
    parser.add_argument(
        "--concurrency",
        metavar="N",
        type=_positive(int),
        default=1,
        help="calls run at once (sync tools each in a thread of its own) (default %(default)s)",
    )
    parser.add_argument(
        "--lease-s",
        metavar="SECONDS",
        type=_positive(float),
        default=defaults.TOOL_LEASE_TTL_S,
        help="seconds a claimed call stays leased without a heartbeat (beats every fifth of "
        "it; lapsed leases of any runner are swept every third) (default %(default)s)",
    )
    parser.add_argument(
        "--grace-s",
        metavar="SECONDS",
        type=_positive(float, zero=True),
        default=DEFAULT_GRACE_S,
        help="on SIGTERM/SIGINT, seconds running calls may take to finish; those still running "
        "are left to their lease, and the sweep decides by the tool's declared effect "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--retries",
        metavar="N",
        type=_positive(int, zero=True),
        default=defaults.TOOL_RETRIES,
        help="env_error failures of one call that are retried; the next one fails the episode "
        "(default %(default)s)",
    )
    add_log_format(parser)


def run(args: argparse.Namespace) -> int:
    configure_logs(args.log_format)
    # The tools first: a typo in --tools is the likeliest mistake, and needs no Redis to see.
    tools = load_tools(args.tools)
    try:
        url = redis_options.resolve(args) or DEFAULT_URL
        queue_url = queue_redis.resolve(url, args.queue_redis)
    except InvalidRedisUrl as exc:
        return _refuse(str(exc))  # its message names the file, never the URL
    if is_cluster_url(url):
        # An episode's tool-call index spans slots: episodes are refused on a cluster store.
        return _refuse(
            "episodes do not run on a Redis Cluster store yet: their tool-call index spans "
            "slots; run the environment runner against one Redis"
        )
    problem = redis_options.check_each(url, queue_url)
    if problem is not None:
        return _refuse(problem)
    log.info("Redis at %s", redact(url))
    config = RunnerConfig(
        runner_id=args.runner_id or f"{socket.gethostname()}:{os.getpid()}",
        queues=tuple(dict.fromkeys(args.queues or (DEFAULT_ENV_QUEUE,))),
        concurrency=args.concurrency,
        lease_s=args.lease_s,
        grace_s=args.grace_s,
    )

    async def main() -> None:
        client = connect(url, client_name="rollouts-env")
        sync = connect_sync(queue_url)  # rq's: the next turns' jobs
        env = EnvironmentClient(EventStore(client), sync, lease_s=config.lease_s,
                                retries=args.retries,
                                queue_apart=queue_redis.apart(url, queue_url))  # fmt: skip
        runner = EnvRunner(env, tools, config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.request_stop)
        try:
            stats = await runner.run()
        finally:
            await client.aclose()
            sync.close()
        print(json.dumps({"runner": config.runner_id, **stats.to_dict()}), flush=True)

    asyncio.run(main())
    return 0


def _queue(text: str) -> str:
    try:
        return check_batch_id(text)  # the rule of an episode's env_queue, which names a key
    except InvalidRolloutId:
        raise argparse.ArgumentTypeError(
            f"a queue name has no braces, colons, whitespace or control characters, got {text!r}"
        ) from None


def _positive(kind: type[int] | type[float], zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (or at least 0 with ``zero``), refused as a
    usage error (exit 2) rather than by the runner's own check."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number is needed, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"must be {'0 or more' if zero else 'above 0'}, got {text}"
            )
        return value

    return parse


def _refuse(message: str) -> int:
    """One line on stderr and exit code 2: a configuration error no restart fixes."""
    print(f"rollouts env: error: {message}", file=sys.stderr, flush=True)
    return 2
