"""``Calls`` on a real redis-server, with no worker: the rollouts are ended by a stand-in that
writes what a worker would (``tests.store.trainer``). A call's batch id and session entry, the
bound on waiting calls, and a disconnected caller under ``keep`` and ``cancel``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from statemachine import RolloutRequest, SamplingParams, Status
from store.api.harness.call import Call, CallerGone, Calls, Overloaded
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.store.trainer import finish

pytestmark = pytest.mark.redis_server
REQUEST = RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=8))


@pytest.fixture
async def client(redis_server: RedisServer, real_redis: object) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(redis_server.url)
    yield c
    await c.aclose()


def test_a_calls_batch_id() -> None:
    keyed = Call("completions", REQUEST, key="k", session="s", body=b"{}")
    assert keyed.batch_id() == Call("completions", REQUEST, key="k", body=b"other").batch_id()
    assert keyed.batch_id() != Call("generate", REQUEST, key="k").batch_id()  # per route
    by_body = Call("completions", REQUEST, session="s", body=b"{}")
    assert by_body.batch_id() == Call("completions", REQUEST, session="s", body=b"{}").batch_id()
    assert by_body.batch_id() != Call("completions", REQUEST, session="t", body=b"{}").batch_id()
    assert by_body.batch_id() != Call("completions", REQUEST, session="s", body=b"[]").batch_id()
    fresh = Call("completions", REQUEST, body=b"{}")
    assert fresh.batch_id() != fresh.batch_id()  # no key, no session: every call is new


async def test_a_call_answers_from_its_rollouts_and_is_listed_in_its_session(
    client: RolloutClient,
) -> None:
    calls = Calls(client)
    call = Call("completions", REQUEST, n=2, session="ep", body=b"x")
    running = asyncio.create_task(calls.run(call))
    [listed] = await _listed(client, "ep")
    for rid in listed.ids:
        await finish(client.store, rid)
    results = await asyncio.wait_for(running, 30)
    assert [r.rollout_id for r in results] == listed.ids == [f"{call.batch_id()}.0.{i}"
                                                            for i in range(2)]  # fmt: skip
    assert all(r.status is Status.DONE for r in results)
    assert results[0].metadata == {"call": "completions", "session": "ep"}
    # A retry attaches: the same results, nothing new recorded.
    again = await Calls(client).run(call)
    assert [r.rollout_id for r in again] == listed.ids
    assert len(await client.session("ep")) == 1 and len(await client.batches()) == 1


async def test_over_max_waiting_is_overloaded_and_records_nothing(client: RolloutClient) -> None:
    calls = Calls(client, max_waiting=1)
    first = asyncio.create_task(calls.run(Call("completions", REQUEST, session="a", body=b"1")))
    [listed] = await _listed(client, "a")
    with pytest.raises(Overloaded):
        await calls.run(Call("completions", REQUEST, session="b", body=b"2"))
    assert await client.session("b") == [] and len(await client.batches()) == 1
    await finish(client.store, listed.ids[0])
    await asyncio.wait_for(first, 30)
    assert calls.waiting == 0


@pytest.mark.parametrize("mode", ["keep", "cancel"])
async def test_a_caller_gone_mid_call(client: RolloutClient, mode: str) -> None:
    """Two samples, one ended before the caller leaves: ``cancel`` cancels the other (an
    ended sample is no error), ``keep`` leaves it to finish; either way the call stops
    waiting and frees its place."""
    calls = Calls(client, max_waiting=1, on_disconnect=mode)
    gone = asyncio.Event()
    call = Call("completions", REQUEST, n=2, session="ep", body=b"x")
    running = asyncio.create_task(calls.run(call, gone=gone.is_set))
    [listed] = await _listed(client, "ep")
    await finish(client.store, listed.ids[0])
    gone.set()
    with pytest.raises(CallerGone):
        await asyncio.wait_for(running, 10)
    assert calls.waiting == 0
    second = "cancelled" if mode == "cancel" else "pending"
    assert await client.statuses(listed.ids) == ["done", second]


async def _listed(client: RolloutClient, session: str) -> list:  # type: ignore[type-arg]
    for _ in range(500):
        found = await client.session(session)
        if found and all(s != "gone" for s in found[0].statuses):
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"session {session} never listed its call")
