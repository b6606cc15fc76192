"""Redis clients that ride out dropped connections and restarts, and fail at once otherwise.

Every command is retried on connection errors and timeouts with capped exponential backoff
and jitter, for up to about ``RETRY_WINDOW_S``. That is safe for everything this project sends:
appends are idempotent (a repeated record is recognised), reads have no effect, and lease
renewals only move expiries forward. Longer outages surface as errors to the caller's own loop.

A wrong or missing password, a missing ACL permission or database is not an outage: no retry
will fix it, so it is raised on the first attempt (it used to take 13-33 s of retries).

Where the URL comes from (``resolve_url``) and how it is shown (``redact``) live here too, so
no password reaches a command line, a log line or an error message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast, overload
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection as AsyncAbstractConnection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ExternalAuthProviderError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from store.cancel_safe import keep_cancels, keeping
from store.cluster_client import RidingCluster
from store.errors import InvalidRedisUrl, unwritable
from store.slots import cluster_nodes, is_cluster_url

try:
    from redis.driver_info import DriverInfo
except ImportError:  # redis-py < 7.1: the version is read once, at import, already
    _DRIVER: dict[str, Any] = {}
else:
    # What CLIENT SETINFO reports, resolved once here: by default redis-py 7 reads its
    # package metadata (importlib.metadata, the email parser) for every new connection,
    # measured at ~1 ms each; a worker starting 256 rollouts at once opened 256 of them.
    _DRIVER = {"driver_info": DriverInfo()}

# Used when no URL is given on the command line, in a file or in the environment.
DEFAULT_URL = "redis://127.0.0.1:6379/0"
# The environment variable a URL (with its password) may come from instead of the command line,
# where every user of the machine sees it in `ps`.
URL_ENV = "ROLLOUTS_REDIS_URL"

# 12 retries with backoff capped at 2 s: about 15 s of outage, e.g. a redis-server restart
# that replays its AOF.
RETRIES = 12
BACKOFF = (2.0, 0.05)  # cap, base (seconds)
SOCKET_TIMEOUT_S = 10.0
RETRY_WINDOW_S = 15.0
_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionResetError, OSError)
# redis-py makes AuthenticationError (WRONGPASS, NOAUTH) and AuthorizationError subclasses of
# ConnectionError, so a plain Retry retries them like a dropped connection. ResponseError
# (an unknown database, NOPERM, AuthenticationWrongNumberOfArgsError) is never retried by
# redis-py; it is listed so the rule reads whole here.
FATAL = (AuthenticationError, AuthorizationError, ExternalAuthProviderError, ResponseError)

T = TypeVar("T")


def retryable(error: Exception) -> bool:
    """Whether another attempt could succeed: outages yes, refused credentials never."""
    return not isinstance(error, FATAL)


def _both(other: Callable[[Exception], bool] | None) -> Callable[[Exception], bool]:
    return lambda error: retryable(error) and (other is None or other(error))


class _Retry(Retry):
    """redis-py's Retry, minus errors no retry can fix. Every call site inside redis-py (the
    connect handshake, each command, health checks) goes through ``call_with_retry``."""

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        return super().call_with_retry(do, fail, _both(is_retryable), with_failure_count)


class _AsyncRetry(AsyncRetry):
    """The same for the asyncio client."""

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        return await super().call_with_retry(do, fail, _both(is_retryable), with_failure_count)


def connect(url: str, *, client_name: str | None = None) -> aredis.Redis:
    """An asyncio client; ``client_name`` names its connections (``CLIENT SETNAME``, on every
    reconnect too), so that ``CLIENT LIST`` shows an operator whose they are. Its connections
    let a task's cancellation through (``store.cancel_safe``)."""
    _not_a_cluster(url)
    client = aredis.Redis.from_url(
        url,
        client_name=client_name,
        retry=_AsyncRetry(EqualJitterBackoff(*BACKOFF), RETRIES),
        retry_on_error=list(_ERRORS),
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2.0,
        health_check_interval=10,
        **_DRIVER,
    )
    return _pings_answered(keep_cancels(client))


def _not_a_cluster(url: str) -> None:
    if is_cluster_url(url):
        raise InvalidRedisUrl(
            "this connection needs one Redis (redis://): a Redis Cluster URL "
            "(redis+cluster://) is for the event store (connect_store), and rq's queue "
            "(--queue-redis) and episodes' environment runners need one Redis"
        )


def connect_cluster(url: str, *, client_name: str | None = None) -> RedisCluster:
    """An asyncio Redis Cluster client for a ``redis+cluster://[user:password@]host:port[,...]``
    URL (``store.slots.cluster_nodes``), retrying as ``connect`` does. Partial slot coverage
    is accepted at start: during a failover some slots have no master for seconds, and the
    store's own writes wait those out (``store.cluster_commit``)."""
    nodes, settings = _cluster_settings(url, ClusterNode)
    client = RidingCluster(
        startup_nodes=nodes,
        client_name=client_name,
        retry=_AsyncRetry(EqualJitterBackoff(*BACKOFF), RETRIES),
        window_s=RETRY_WINDOW_S,
        backoff=BACKOFF,
        retryable=retryable,
        **settings,
        **_DRIVER,
    )
    # As ``connect``'s connections: cancel-safe, and alive while Redis answers MISCONF. redis-py
    # takes every node's connection class from these settings, shared with its nodes manager
    # (nodes found later), and gave the seed nodes theirs already.
    kind = _answered(keeping(client.connection_kwargs["connection_class"]), _AsyncPingAnswered)
    client.connection_kwargs["connection_class"] = kind
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = kind
    return client


def connect_store(url: str, *, client_name: str | None = None) -> aredis.Redis:
    """The store's asyncio client: a cluster's (``connect_cluster``) for a
    ``redis+cluster://`` URL, else ``connect``'s. Typed as one Redis: a cluster's client
    answers the same commands, and what it cannot do (a step spanning slots) is refused by
    name where it is tried (``store.cluster_appends.ClusterUnsupported``)."""
    if is_cluster_url(url):
        return cast(aredis.Redis, connect_cluster(url, client_name=client_name))
    return connect(url, client_name=client_name)


def connect_sync_store(url: str) -> redis.Redis:
    """``connect_store`` for synchronous code (a submit's records, from a thread)."""
    if not is_cluster_url(url):
        return connect_sync(url)
    nodes, settings = _cluster_settings(url, SyncClusterNode)
    client = SyncRedisCluster(
        startup_nodes=nodes, retry=_Retry(EqualJitterBackoff(*BACKOFF), RETRIES), **settings
    )
    return cast(redis.Redis, client)


def _cluster_settings(
    url: str, node: Callable[[str, int], Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A cluster URL's seed nodes (made by ``node``) and the settings both of redis-py's
    cluster clients take alike: the credentials, partial coverage accepted, our timeouts and
    the errors retried."""
    parts = urlsplit(url)
    try:
        nodes = [node(host, port) for host, port in cluster_nodes(url)]
    except ValueError as exc:
        raise InvalidRedisUrl(f"not a Redis Cluster URL: {exc}".replace(url, redact(url))) from None
    return nodes, {
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "require_full_coverage": False,
        "retry_on_error": list(_ERRORS),
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 2.0,
    }


def connect_sync(url: str) -> redis.Redis:
    _not_a_cluster(url)
    return _pings_answered(
        redis.Redis.from_url(
            url,
            retry=_Retry(EqualJitterBackoff(*BACKOFF), RETRIES),
            retry_on_error=list(_ERRORS),
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            **_DRIVER,
        )
    )


C = TypeVar("C", aredis.Redis, redis.Redis)


def _pings_answered(client: C) -> C:
    """``client``, whose health-check PING (on every new connection, and on one idle for
    ``health_check_interval``) counts a MISCONF reply as an answer. Redis refuses PING, like a
    write, while it cannot persist (a failed RDB save or AOF write): the connection is alive,
    and failing it would fail every command, reads included, and every new connection (the
    API's /healthz, ``rollouts status``, a worker's next round trip) for as long as that lasts.
    Writes are still refused, each with its own MISCONF (``store.errors.StoreUnwritable``)."""
    pool = client.connection_pool
    mixin = _AsyncPingAnswered if isinstance(client, aredis.Redis) else _PingAnswered
    pool.connection_class = _answered(pool.connection_class, mixin)
    return client


def _answered(base: type, mixin: type) -> type:
    made = _PINGS.get(base)
    if made is None:
        made = _PINGS[base] = type(f"PingAnswered{base.__name__}", (mixin, base), {})
    return made


_PINGS: dict[type, type] = {}


class _PingAnswered(redis.connection.AbstractConnection):
    def _send_ping(self) -> None:
        try:
            super()._send_ping()  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if unwritable(exc) is None:
                raise
            # Redis answered (MISCONF): the connection is alive; see _pings_answered.


class _AsyncPingAnswered(AsyncAbstractConnection):
    async def _send_ping(self) -> None:
        try:
            await super()._send_ping()  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if unwritable(exc) is None:
                raise
            # Redis answered (MISCONF): the connection is alive; see _pings_answered.


# CLIENT SETNAME refuses spaces and anything outside printable ASCII.
_UNNAMEABLE = re.compile(r"[^\x21-\x7e]")


def client_name(kind: str, name: str) -> str:
    """A valid connection name for ``name`` (a worker id may hold any character)."""
    return f"{kind}:{_UNNAMEABLE.sub('_', name)}"


_QUERY_PASSWORD = re.compile(r"(?i)(^|&)(password=)[^&]*")


def redact(url: str) -> str:
    """``url`` fit for a log line: the password (userinfo or ``?password=``) becomes ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # e.g. an unclosed IPv6 bracket: showing any of it could show the password.
        return "<unparseable Redis URL>"
    shown = url
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        # The netloc follows "scheme://", its first occurrence. (urlunsplit would drop the
        # "//" of "unix:///path", so the URL is spliced, not rebuilt.)
        user = userinfo.split(":", 1)[0]
        shown = shown.replace(parts.netloc, f"{user}:***@{host}", 1)
    if parts.query:
        query = _QUERY_PASSWORD.sub(r"\1\2***", parts.query)
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown


@overload
def resolve_url(
    flag: str | None,
    url_file: str | Path | None,
    env: Mapping[str, str] | None = None,
    *,
    default: str = DEFAULT_URL,
) -> str: ...
@overload
def resolve_url(
    flag: str | None,
    url_file: str | Path | None,
    env: Mapping[str, str] | None = None,
    *,
    default: None,
) -> str | None: ...
def resolve_url(
    flag: str | None,
    url_file: str | Path | None,
    env: Mapping[str, str] | None = None,
    *,
    default: str | None = DEFAULT_URL,
) -> str | None:
    """The Redis URL: ``--redis`` flag, else the file ``--redis-url-file``, else ``$URL_ENV``,
    else ``default``. ``env`` defaults to ``os.environ``."""
    if flag:
        return flag
    if url_file is not None:
        return _read_url_file(Path(url_file))
    # Set but empty counts as unset, as a shell's `ROLLOUTS_REDIS_URL= cmd` means.
    return (os.environ if env is None else env).get(URL_ENV) or default


def _read_url_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        # Missing, unreadable or binary: say which file and why, never its content.
        reason = type(exc).__name__
        raise InvalidRedisUrl(f"cannot read the Redis URL file {path}: {reason}") from None
    lines = text.split()
    if len(lines) != 1:
        raise InvalidRedisUrl(
            f"the Redis URL file {path} must hold one URL, found {len(lines)} words"
        )
    return lines[0]
