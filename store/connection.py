"""Redis clients that ride out dropped connections and restarts.

Every command is retried on connection errors and timeouts with capped exponential backoff
and jitter, for up to about ``RETRY_WINDOW_S``. That is safe for everything this project sends:
appends are idempotent (a repeated record is recognised), reads have no effect, and lease
renewals only move expiries forward. Longer outages surface as errors to the caller's own loop.
"""

from __future__ import annotations

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# 12 retries with backoff capped at 2 s: about 15 s of outage, e.g. a redis-server restart
# that replays its AOF.
RETRIES = 12
BACKOFF = (2.0, 0.05)  # cap, base (seconds)
SOCKET_TIMEOUT_S = 10.0
RETRY_WINDOW_S = 15.0
_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionResetError, OSError)


def connect(url: str) -> aredis.Redis:
    return aredis.Redis.from_url(
        url,
        retry=AsyncRetry(EqualJitterBackoff(*BACKOFF), RETRIES),
        retry_on_error=list(_ERRORS),
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2.0,
        health_check_interval=10,
    )


def connect_sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        retry=Retry(EqualJitterBackoff(*BACKOFF), RETRIES),
        retry_on_error=list(_ERRORS),
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2.0,
        health_check_interval=10,
    )
