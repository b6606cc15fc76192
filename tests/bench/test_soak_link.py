"""The soak's link proxy (``bench/soak_link.py``): clean, it is a wire; slow, it adds its
latency and drops connections; a client through it reaches a real redis-server."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from soak_link import CLEAN, LinkMode, LinkProxy  # bench/ is on the path (conftest.py)

from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[LinkProxy]:
    p = LinkProxy(server.port, seed=1)
    p.start()
    yield p
    p.stop()


def round_trip_s(client: redis.Redis, n: int = 5) -> float:
    t0 = time.monotonic()
    for _ in range(n):
        client.ping()
    return (time.monotonic() - t0) / n


def test_clean_link_is_a_wire_and_a_slow_one_adds_its_latency(proxy: LinkProxy) -> None:
    client = redis.Redis(port=proxy.port)
    try:
        client.set("k", b"v" * 100_000)
        assert client.get("k") == b"v" * 100_000  # bytes through, in order, whole
        assert round_trip_s(client) < 0.04
        proxy.set_mode(LinkMode(latency_s=(0.05, 0.1)))
        slow = round_trip_s(client)
        # Each way 50-100 ms: a round trip 100-200 ms (plus a loaded machine's scheduling).
        assert 0.1 <= slow < 0.6, slow
        proxy.set_mode(CLEAN)
        assert round_trip_s(client) < 0.04
    finally:
        client.close()


def test_slow_link_drops_connections(proxy: LinkProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64) == b"+PONG\r\n"
        proxy.set_mode(LinkMode(drops_per_s=20.0))  # every tick drops every connection
        try:
            got = s.recv(64)
        except ConnectionResetError:
            got = b""  # reset, as a broken middlebox does
        assert got == b""  # closed under it, nothing more to read
    assert proxy.drops == 1
    proxy.set_mode(CLEAN)
    assert redis.Redis(port=proxy.port).ping()  # a new connection goes through again


def test_a_stopped_proxy_refuses_and_ends_its_thread(server: RedisServer) -> None:
    p = LinkProxy(server.port)
    port = p.start()
    assert redis.Redis(port=port).ping()
    p.stop()
    assert p._thread is not None and not p._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
