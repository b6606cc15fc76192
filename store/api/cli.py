"""``rollouts api``: serve the trainer API over HTTP until SIGTERM/SIGINT.

Heavy imports (aiohttp, pydantic, prometheus_client) happen in ``run``, so ``rollouts --help``
stays instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from store import defaults, queue_redis, redis_options
from store.connection import DEFAULT_URL, redact
from store.errors import InvalidRedisUrl
from store.logs import add_log_format
from store.slots import is_cluster_url

TOKEN_ENV = "ROLLOUTS_API_TOKEN"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = defaults.API_MAX_BODY_BYTES


def configure(parser: argparse.ArgumentParser) -> None:
    redis_options.add_arguments(parser, otherwise=DEFAULT_URL)
    queue_redis.add_argument(parser)
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0 "
        "exposes the API: set a token)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--token",
        help=f"bearer token every endpoint but /healthz and /openapi.json requires (default: "
        f"${TOKEN_ENV}, else none: no authentication). Visible in `ps`: prefer the variable",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; a larger one gets 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--queue",
        default=defaults.QUEUE_NAME,
        help=f"rq queue the submitted rollouts go to (default {defaults.QUEUE_NAME})",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local tokenizer directory (HF layout) whose chat template turns chat messages "
        "into prompt token ids (default: none; prompts must then be token ids, and "
        "/v1/chat/completions is not served: a call to it gets 422 no_tokenizer)",
    )
    parser.add_argument(
        "--served-model-name", metavar="NAME",
        help="the model id /v1/models answers and harness calls name (default: the --tokenizer "
        "path, else durable-rollouts; when set, a call naming another model gets 404)",
    )  # fmt: skip
    parser.add_argument(
        "--max-model-len", type=int, metavar="TOKENS",
        help="the context length /v1/models and /tokenize report, and a generate call without "
        "max_tokens fills (default: the --tokenizer dir's config.json, else unknown)",
    )  # fmt: skip
    parser.add_argument(
        "--max-waiting", type=int, default=defaults.API_MAX_WAITING,
        help="harness calls (/inference/v1/generate, /v1/completions, ...) waiting at once on "
        "this API; one more is refused with a status its client retries by itself "
        f"(default {defaults.API_MAX_WAITING})",
    )  # fmt: skip
    parser.add_argument(
        "--call-timeout", type=float, default=defaults.API_CALL_TIMEOUT_S, metavar="SECONDS",
        help="how long a harness call waits for its rollouts; then it is answered 504 (its "
        "rollouts go on, and a retry under the same key attaches to them) "
        f"(default {defaults.API_CALL_TIMEOUT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--on-disconnect", choices=defaults.ON_DISCONNECT, default="keep",
        help="a harness caller that disconnects mid-call: keep its rollouts (they finish, a "
        "retry attaches, retention expires them) or cancel them (default keep)",
    )  # fmt: skip
    redis_options.add_min_replicas_acked(
        parser, "a submit, cancel, ack or weight version", "it is answered 503: retry it as it was"
    )
    add_log_format(parser)


def run(args: argparse.Namespace) -> int:
    from store import logs  # noqa: PLC0415

    logs.configure(args.log_format)
    try:
        url = redis_options.resolve(args) or DEFAULT_URL
        queue_url = queue_redis.resolve(url, args.queue_redis)
    except InvalidRedisUrl as exc:
        return _refuse(str(exc))  # names the file or the flag, never the URL
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        return _refuse(f"the API token (--token or ${TOKEN_ENV}) is empty")
    if args.max_waiting < 1:
        return _refuse(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.max_model_len is not None and args.max_model_len < 1:
        return _refuse(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if not 0 < args.call_timeout < float("inf"):
        return _refuse(f"--call-timeout must be > 0 seconds, got {args.call_timeout}")
    if args.max_body_bytes < 1024:
        return _refuse(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    for each in dict.fromkeys((url, queue_url)):  # the queue's Redis too, when its own
        problem = _check(each)
        if problem is not None:
            return _refuse(problem)
    return _serve(args, url, queue_url, token)


def _check(url: str) -> str | None:
    """``redis_options.check``, or for a Redis Cluster (``--redis redis+cluster://...``): its
    slot map read from the nodes listed (a cluster client does so when made), then closed."""
    if not is_cluster_url(url):
        return redis_options.check(url)
    from redis.exceptions import RedisError  # noqa: PLC0415

    from store.connection import connect_sync_store  # noqa: PLC0415

    try:
        client = connect_sync_store(url)
    except InvalidRedisUrl as exc:
        return str(exc)
    except (RedisError, OSError) as exc:  # no node listed answers, or refused the client
        return f"cannot reach the Redis Cluster at {redact(url)}: {exc}"
    client.close()
    return None


def _serve(args: argparse.Namespace, url: str, queue_url: str, token: str | None) -> int:
    from aiohttp import web  # noqa: PLC0415

    from store.client import RolloutClient  # noqa: PLC0415
    from store.logs import log_event  # noqa: PLC0415

    from .app import make_app  # noqa: PLC0415
    from .harness.call import Calls  # noqa: PLC0415
    from .harness.served import from_args  # noqa: PLC0415

    log = logging.getLogger("rollouts.api")
    tokenizer: Any = None
    if args.tokenizer:
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)

    async def app() -> web.Application:
        client = RolloutClient(url, queue_url=queue_url, queue_name=args.queue,
                               tokenizer=tokenizer,
                               min_replicas_acked=args.min_replicas_acked)  # fmt: skip
        served = from_args(args.served_model_name, args.max_model_len, args.tokenizer)
        calls = Calls(client, max_waiting=args.max_waiting, on_disconnect=args.on_disconnect,
                      timeout_s=args.call_timeout, served=served)  # fmt: skip
        return make_app(client, token=token, max_body_bytes=args.max_body_bytes,
                        close_client=True, calls=calls)  # fmt: skip

    log_event(log, logging.INFO, "start", "API listening", host=args.host, port=args.port,
              redis=redact(url), queue_redis=redact(queue_url), auth=token is not None,
              queue=args.queue)  # fmt: skip
    try:
        web.run_app(app(), host=args.host, port=args.port, access_log=None, print=None)
    except OSError as exc:  # the port is taken, or the address is not this machine's
        return _refuse(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0


def _refuse(message: str) -> int:
    """One line on stderr, exit 2 (a configuration error, as argparse's): no traceback."""
    print(f"rollouts api: error: {message}", file=sys.stderr, flush=True)
    return 2
