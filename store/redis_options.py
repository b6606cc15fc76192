"""The Redis options every subcommand shares, and the worker's check that Redis lets it in.

The URL (and its password) is best kept off the command line, where `ps` shows it to every
user: ``--redis-url-file`` reads it from a file (e.g. a mounted Kubernetes secret) and
``$ROLLOUTS_REDIS_URL`` from the environment. ``--redis`` still wins when given.
"""

from __future__ import annotations

import argparse

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from store.connection import URL_ENV, connect_sync_store, redact, resolve_url


def add_arguments(parser: argparse.ArgumentParser, *, otherwise: str, use_env: bool = True) -> None:
    """``--redis`` and ``--redis-url-file``; ``otherwise`` says what happens with neither.
    ``use_env``: whether ``$ROLLOUTS_REDIS_URL`` counts (not for the demo, which must not
    write into a deployment's Redis just because the variable is set in the shell)."""
    env = f"else ${URL_ENV}, " if use_env else ""
    parser.add_argument(
        "--redis",
        metavar="URL",
        help=f"Redis URL (default: from --redis-url-file, {env}else {otherwise}). "
        "A password given here is visible in `ps`: prefer the file"
        + (" or the variable" if use_env else ""),
    )
    parser.add_argument(
        "--redis-url-file",
        metavar="PATH",
        help="file holding the Redis URL, e.g. a mounted Kubernetes secret (default: none)",
    )


def add_min_replicas_acked(parser: argparse.ArgumentParser, what: str, meanwhile: str) -> None:
    """``--min-replicas-acked N``: ``what`` (a checkpoint, a trainer's write) counts as saved
    once N replicas of its Redis confirm it (docs/scale.md); ``meanwhile``: what happens to
    it until they do."""
    parser.add_argument(
        "--min-replicas-acked",
        type=_replica_count,
        default=0,
        metavar="N",
        help=f"count {what} saved only once N replicas of its Redis confirm it (WAIT, 1 s at "
        f"most; until then {meanwhile}): a failover then loses nothing acknowledged. 0: saved "
        "once the master has it (default %(default)s)",
    )


def _replica_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count of replicas is a number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a count of replicas is 0 or more, got {n}")
    return n


def resolve(args: argparse.Namespace, *, use_env: bool = True) -> str | None:
    """The URL from the flag, the file or (``use_env``) the environment; None if none does."""
    return resolve_url(args.redis, args.redis_url_file, None if use_env else {}, default=None)


def check(url: str) -> str | None:
    """Ping Redis with the worker's own client settings. None when it answers; otherwise one
    line saying why not, without the password. Refused credentials fail at once; an
    unreachable server after the client's usual retries (about 15 s).

    The line quotes redis-py's message, which names host and port, never the URL or its
    password (read in redis/connection.py: parse_url, _error_message); the URL is redacted."""
    try:
        client = connect_sync_store(url)  # a cluster's answers from one of its nodes
    except ValueError as exc:
        # redis-py refuses the URL itself (its scheme, port or database number).
        return f"invalid Redis URL {redact(url)}: {exc}"
    except (RedisError, RedisClusterException, OSError) as exc:
        # A cluster's client asks its nodes for the slot map as it is made.
        return f"cannot reach Redis at {redact(url)}: {exc}"
    try:
        client.ping()
    except AuthenticationError as exc:
        # WRONGPASS, or NOAUTH when the URL has no password.
        return f"Redis authentication failed at {redact(url)}: {exc}"
    except (AuthorizationError, ResponseError) as exc:
        # An ACL user without PING, or a database number the server does not have.
        return f"Redis at {redact(url)} refused the worker: {exc}"
    except (RedisError, OSError) as exc:
        # Down, unreachable or timing out through every retry.
        return f"cannot reach Redis at {redact(url)}: {exc}"
    finally:
        client.close()
    return None


def check_each(*urls: str) -> str | None:
    """``check`` for each distinct URL (the store's, the queue's when apart): the first
    problem, or None."""
    for url in dict.fromkeys(urls):
        problem = check(url)
        if problem is not None:
            return problem
    return None
