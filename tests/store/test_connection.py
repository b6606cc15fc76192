"""Connecting to Redis: a wrong password or database fails at once (never after the ~15 s of
retries meant for outages), an outage is still ridden out, and no URL is ever printed with its
password."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError, ResponseError

from store import connection, errors
from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server

PASSWORD = "s3cret"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that wants a password (its readiness probe must cope with NOAUTH)."""
    with RedisServer(tmp_path / "redis", config={"requirepass": PASSWORD}) as s:
        yield s


def url(server: RedisServer, password: str | None, db: int = 0) -> str:
    auth = f":{password}@" if password is not None else ""
    return f"redis://{auth}127.0.0.1:{server.port}/{db}"


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong-password", "no-password"])
async def test_async_client_refuses_a_bad_password_at_once(
    server: RedisServer, password: str | None
) -> None:
    client = connection.connect(url(server, password))
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong-password", "no-password"])
def test_sync_client_refuses_a_bad_password_at_once(
    server: RedisServer, password: str | None
) -> None:
    client = connection.connect_sync(url(server, password))
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            client.ping()
    finally:
        client.close()
    assert time.monotonic() - t0 < 2.0


async def test_the_right_password_works_and_a_missing_database_fails_at_once(
    server: RedisServer,
) -> None:
    client = connection.connect(url(server, PASSWORD))
    assert await client.ping()
    await client.aclose()
    t0 = time.monotonic()
    missing = connection.connect_sync(url(server, PASSWORD, db=99_999))
    with pytest.raises(ResponseError, match="DB index"):
        missing.ping()
    missing.close()
    with pytest.raises(ValueError, match="scheme"):
        connection.connect_sync(f"http://127.0.0.1:{server.port}/0")
    assert time.monotonic() - t0 < 2.0


def restart_in(server: RedisServer, seconds: float) -> threading.Thread:
    server.stop()
    restart = threading.Timer(seconds, server.start)
    restart.start()
    return restart


def test_sync_client_still_rides_out_a_restart(server: RedisServer) -> None:
    client = connection.connect_sync(url(server, PASSWORD))
    assert client.ping()
    restart = restart_in(server, 1.5)
    try:
        assert client.ping()  # refused connections are retried until the server is back
    finally:
        restart.join()
        client.close()


async def test_async_client_still_rides_out_a_restart(server: RedisServer) -> None:
    client = connection.connect(url(server, PASSWORD))
    assert await client.ping()
    restart = restart_in(server, 1.5)
    try:
        assert await client.ping()
    finally:
        restart.join()
        await client.aclose()


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("redis://:hunter2@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://alice:hunter2@host/1", "redis://alice:***@host/1"),
        ("rediss://alice:p%40ss@host:6380", "rediss://alice:***@host:6380"),
        ("redis://alice@host", "redis://alice@host"),  # a user name alone is no secret
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("unix:///tmp/r.sock?db=1&password=hunter2", "unix:///tmp/r.sock?db=1&password=***"),
        ("redis://host/0?PassWord=hunter2&x=1", "redis://host/0?PassWord=***&x=1"),
        ("redis://:a@b@host/0", "redis://:***@host/0"),  # '@' inside the password
        ("redis://[::1", "<unparseable Redis URL>"),
    ],
)
def test_redact_hides_every_password(raw: str, shown: str) -> None:
    assert connection.redact(raw) == shown


def test_url_resolution_order(tmp_path: Path) -> None:
    resolve, default = connection.resolve_url, connection.DEFAULT_URL
    secret = tmp_path / "redis-url"
    secret.write_text("redis://:from-file@host/0\n")  # a Kubernetes secret ends with a newline
    env = {connection.URL_ENV: "redis://:from-env@host/0"}
    assert connection.URL_ENV == "ROLLOUTS_REDIS_URL"
    assert resolve("redis://flag/0", secret, env) == "redis://flag/0"
    assert resolve(None, secret, env) == "redis://:from-file@host/0"
    assert resolve(None, None, env) == "redis://:from-env@host/0"
    assert resolve(None, None, {}) == default == "redis://127.0.0.1:6379/0"
    assert resolve(None, None, {connection.URL_ENV: ""}) == default  # set but empty: unset
    assert resolve(None, None, {}, default=None) is None


@pytest.mark.parametrize("content", [None, "", "  \n", "redis://a/0\nredis://b/0\n"])
def test_a_bad_url_file_is_refused_without_echoing_it(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "redis-url"
    if content is not None:
        path.write_text(content)
    with pytest.raises(errors.InvalidRedisUrl, match="redis-url") as info:
        connection.resolve_url(None, path, {})
    assert "redis://" not in str(info.value)


def test_a_cluster_url_is_refused_where_one_redis_is_needed_and_says_why() -> None:
    from store.connection import connect, connect_cluster, connect_sync

    url = "redis+cluster://u:secret@127.0.0.1:7000,127.0.0.1:7001"
    for make in (connect, connect_sync):
        with pytest.raises(errors.InvalidRedisUrl, match="needs one Redis") as refused:
            make(url)
        assert "secret" not in str(refused.value)
    with pytest.raises(errors.InvalidRedisUrl, match="host:port pairs") as bad:
        connect_cluster("redis+cluster://u:secret@127.0.0.1")
    assert "secret" not in str(bad.value)
