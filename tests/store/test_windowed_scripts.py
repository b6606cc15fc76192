"""``scripts.run_windowed_sync``: script calls kept in flight while the caller builds the next
(the submit path), on a real redis-server: replies in order, NOSCRIPT and a lost connection
repeated safely, any other error raised with the connection left clean."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis
from redis.exceptions import ResponseError

from store import scripts
from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server

# Appends its argument to a list and answers the list's length: a repeat would show.
COUNTER = scripts.Script(
    "counter", "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])"
)


@pytest.fixture
def sync(redis_server: RedisServer, real_redis: aredis.Redis) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_server.url)
    conn.script_flush()
    yield conn
    conn.close()


def calls(n: int, key: str = "k") -> Iterator[tuple[list[str], list[str]]]:
    for i in range(n):
        yield [key], [str(i)]


@pytest.mark.parametrize("window", [1, 2, 5])
def test_replies_come_in_call_order_and_each_call_runs_once(sync: redis.Redis, window: int) -> None:
    sync.script_load(COUNTER.text)
    replies = scripts.run_windowed_sync(sync, COUNTER, calls(7), window=window)
    assert replies == [1, 2, 3, 4, 5, 6, 7]
    assert sync.lrange("k", 0, -1) == [str(i).encode() for i in range(7)]


def test_calls_refused_as_noscript_run_again_by_text_once(sync: redis.Redis) -> None:
    # Not loaded yet: loaded before the first call.
    assert scripts.run_windowed_sync(sync, COUNTER, calls(2, "a"), window=2) == [1, 2]
    flusher = redis.Redis(
        **{k: sync.connection_pool.connection_kwargs[k] for k in ("host", "port")}
    )

    def flushed_mid_window() -> Iterator[tuple[list[str], list[str]]]:
        for i in range(4):
            if i == 1:
                flusher.script_flush()  # what a restart does to the cache, mid-submit
            yield ["k"], [str(i)]

    # The calls after the flush are refused NOSCRIPT without running, then run by their text:
    # each lands exactly once, and the replies stay in call order.
    replies = scripts.run_windowed_sync(sync, COUNTER, flushed_mid_window(), window=2)
    flusher.close()
    assert sync.lrange("k", 0, -1) == [b"0", b"1", b"2", b"3"]
    assert replies == [1, 2, 3, 4]


def test_an_error_reply_is_raised_and_the_connection_stays_usable(sync: redis.Redis) -> None:
    sync.script_load(COUNTER.text)
    sync.set("not-a-list", "x")  # RPUSH onto a string: WRONGTYPE inside the script

    def mixed() -> Iterator[tuple[list[str], list[str]]]:
        yield ["k"], ["a"]
        yield ["not-a-list"], ["b"]
        yield ["k"], ["c"]

    with pytest.raises(ResponseError, match="WRONGTYPE"):
        scripts.run_windowed_sync(sync, COUNTER, mixed(), window=3)
    # The unread replies went with the connection: the next command reads its own reply.
    assert sync.ping() is True
    assert sync.lrange("k", 0, -1) == [b"a", b"c"]


def test_a_connection_lost_mid_window_repeats_the_unanswered_calls(
    sync: redis.Redis,
) -> None:
    sync.script_load(COUNTER.text)
    # The pool's one connection: run_windowed_sync takes the same one back.
    target = sync.client_id()
    killer = redis.Redis(**{k: sync.connection_pool.connection_kwargs[k] for k in ("host", "port")})

    def cut_after_two() -> Iterator[tuple[list[str], list[str]]]:
        for i in range(5):
            if i == 2:
                # Killed between sends: the replies of the calls in flight are lost, whether
                # or not they ran.
                killer.client_kill_filter(_id=target)
            yield ["k"], [str(i)]

    replies = scripts.run_windowed_sync(sync, COUNTER, cut_after_two(), window=2)
    killer.close()
    pushed = sync.lrange("k", 0, -1)
    assert set(pushed) == {b"0", b"1", b"2", b"3", b"4"}  # every call ran
    assert pushed.count(b"0") == 1  # answered before the cut: never repeated
    # A call that ran before the cut but whose reply was lost runs again (at most once more):
    # why only scripts that recognise a repeat (submit_chunk answers "dup") run this way.
    assert len(pushed) <= 6
    assert replies[0] == 1 and replies[-1] == len(pushed)


def test_an_error_building_a_call_is_raised_after_the_sent_calls_are_answered(
    sync: redis.Redis,
) -> None:
    # Even an error that looks like a lost connection: it is the caller's, and the call it
    # was building must not be taken as sent.
    def failing() -> Iterator[tuple[list[str], list[str]]]:
        yield ["k"], ["0"]
        yield ["k"], ["1"]
        raise ConnectionError("building the third call failed")

    with pytest.raises(ConnectionError, match="third call"):
        scripts.run_windowed_sync(sync, COUNTER, failing(), window=5)
    assert sync.lrange("k", 0, -1) == [b"0", b"1"]  # both sent calls ran, once each


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_script_not_cached_yet_runs_each_call_once_in_order(
    sync: redis.Redis, window: int
) -> None:
    """No SCRIPT EXISTS probe: the first calls meet NOSCRIPT, run again by the script's text
    before any later call is sent, and the rest go by sha (cached by then)."""
    replies = scripts.run_windowed_sync(sync, COUNTER, calls(5), window=window)
    assert sync.lrange("k", 0, -1) == [b"0", b"1", b"2", b"3", b"4"]
    assert replies == [1, 2, 3, 4, 5]
    assert sync.script_exists(COUNTER.sha) == [True]
