"""Redis refusing writes for a condition of its own (issue 28), as the store sees it.

- ``store.errors.unwritable`` names each condition's reply, wherever redis-py puts it (a bare
  reply, a transaction's EXECABORT, a pipeline's annotation, a script's error), and nothing
  else;
- on a real redis-server in each condition (out of memory, a failed RDB save, a read-only
  replica): an append is refused with nothing written, and classified; ``store.writable``
  says why without writing anything, and None once the condition is lifted;
- under MISCONF Redis refuses PING too: a new connection's health check must not fail every
  command (reads included) for as long as the disk is broken.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    ExecAbortError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from statemachine import Submitted
from store import EventStore, writable
from store.connection import connect, connect_sync
from store.errors import Refusal, StoreUnwritable, unwritable, writes_named
from store.keys import Keys
from store.redis_server import RedisServer
from tests import factories as f
from tests.unwritable import REFUSALS, conditions, oom_hold, wait_accepting, wait_refusing

OOM = "command not allowed when used memory > 'maxmemory'."
MISCONF = (
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist "
    "to disk. Commands that may modify the data set are disabled"
)
READONLY = "You can't write against a read only replica."


@pytest.mark.parametrize(
    ("error", "refusal", "detail"),
    [
        (OutOfMemoryError(OOM), Refusal.OOM, f"OOM {OOM}"),
        (ResponseError(f"Command # 2 (XADD k * e v) of pipeline caused error: {OOM}"),
         Refusal.OOM, f"OOM {OOM}"),
        (OutOfMemoryError(f"Command # 2 (XADD k * e v) of pipeline caused error: {OOM}"),
         Refusal.OOM, f"OOM {OOM}"),
        (ExecAbortError(f"Transaction discarded because of: OOM {OOM}"), Refusal.OOM,
         f"OOM {OOM}"),
        (ResponseError(f"OOM {OOM} script: 6b1f, on @user_script:12."), Refusal.OOM,
         f"OOM {OOM} script: 6b1f, on @user_script:12."),
        (ResponseError(MISCONF), Refusal.MISCONF, MISCONF),
        (ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
         Refusal.MISCONF, "MISCONF Errors writing to the AOF file: No space left on device"),
        (ExecAbortError(f"Transaction discarded because of: {MISCONF}"), Refusal.MISCONF,
         MISCONF),
        (ReadOnlyError(READONLY), Refusal.READONLY, f"READONLY {READONLY}"),
        (ResponseError(f"Command # 1 (SET a b) of pipeline caused error: READONLY {READONLY}"),
         Refusal.READONLY, f"READONLY {READONLY}"),
    ],
)  # fmt: skip
def test_each_condition_is_named_wherever_redis_py_puts_it(
    error: Exception, refusal: Refusal, detail: str
) -> None:
    named = unwritable(error)
    assert named is not None
    assert (named.refusal, named.detail) == (refusal, detail)
    assert str(named) == f"Redis refuses writes ({refusal.value}): {detail}"
    assert unwritable(named) is named
    with pytest.raises(StoreUnwritable) as raised, writes_named():
        raise error
    assert raised.value.refusal is refusal and raised.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        ResponseError("ERR value is not an integer or out of range"),
        NoScriptError("No matching script. Please use EVAL."),
        ExecAbortError("Transaction discarded because of previous errors."),
        RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        ValueError("OOM command not allowed"),  # not Redis's reply
    ],
)
def test_anything_else_is_not_a_condition(error: Exception) -> None:
    assert unwritable(error) is None
    with pytest.raises(type(error)), writes_named():
        raise error


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.mark.redis_server
@pytest.mark.parametrize("refusal", REFUSALS)
async def test_an_append_refused_writes_nothing_and_is_named(
    server: RedisServer, tmp_path: Path, refusal: str
) -> None:
    on, off = conditions(tmp_path)[refusal]
    sync = Redis.from_url(server.url)
    client = connect(server.url)
    store, keys = EventStore(client), Keys()
    try:
        assert await writable.refusal(client, keys) is None
        # A replica's data is its primary's (none): there, the submit itself is refused.
        state = None if refusal == "readonly" else await _live(store)
        on(sync, server)
        if refusal == "oom":
            oom_hold(sync)
        wait_refusing(sync)
        before = {k: sync.dump(k) for k in sync.keys("*")}
        event = (
            Submitted(rollout_id="r", seq=1, request=f.request(8))
            if state is None
            else (f.tokens(state))
        )
        with pytest.raises(ResponseError) as raised:
            await store.append(state, event)
        named = unwritable(raised.value)
        assert named is not None and named.refusal.value == refusal, raised.value
        found = await writable.refusal(client, keys)
        assert found is not None and found.refusal.value == refusal
        assert {k: sync.dump(k) for k in sync.keys("*")} == before  # neither wrote anything
        off(sync, server)
        wait_accepting(sync)
        assert await writable.refusal(client, keys) is None
        assert not sync.exists(keys.write_probe())
        if state is not None:  # the same append, once Redis accepts writes
            after = await store.append(state, f.tokens(state))
            assert after.num_tokens == state.num_tokens + len(f.tokens(state))
    finally:
        off(sync, server)
        await client.aclose()
        sync.close()


async def _live(store: EventStore):  # type: ignore[no-untyped-def]
    s = await store.append(None, Submitted(rollout_id="r", seq=1, request=f.request(64)))
    return await store.append(s, f.started(s, worker="w"))


@pytest.mark.redis_server
async def test_new_connections_work_under_misconf(server: RedisServer, tmp_path: Path) -> None:
    """Redis refuses PING while it cannot persist; redis-py PINGs every new connection (and one
    idle for its health-check interval) before the first command. Before, every command on a
    new connection failed with MISCONF, reads included: ``rollouts status``, /healthz and a
    worker's next round trip."""
    on, off = conditions(tmp_path)["misconf"]
    sync = Redis.from_url(server.url)
    sync.set("k", "v")
    on(sync, server)
    wait_refusing(sync)
    client, fresh_sync = connect(server.url), connect_sync(server.url)
    try:
        assert await client.get("k") == b"v"  # a new connection, health-checked: a read works
        assert fresh_sync.get("k") == b"v"
        with pytest.raises(ResponseError) as raised:
            await client.set("k", "w")  # writes are still refused, each with its own MISCONF
        assert unwritable(raised.value) is not None
        assert await client.get("k") == b"v"
    finally:
        off(sync, server)
        await client.aclose()
        fresh_sync.close()
        sync.close()
