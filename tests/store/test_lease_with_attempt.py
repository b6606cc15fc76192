"""An attempt's lease taken in the transaction that opens it (``Leases.take_steps`` as
``EventStore.append_many``'s ``before``), on fakeredis and a real redis-server: the lease and
the event land together, a chain refused before anything is sent sends no lease either, and
a lease step Redis refuses fails its own chain only."""

from __future__ import annotations

import redis.asyncio as aredis

from statemachine import RolloutState, Status
from statemachine.errors import TransitionError
from store import AppendRefused, EventStore
from store.leases import Leases
from tests import factories as f

TTL = 30.0


async def _pending(store: EventStore, rid: str) -> RolloutState:
    return await store.append(None, f.submitted(rid))


async def test_the_lease_lands_with_the_attempt_it_opens(redis_client: aredis.Redis) -> None:
    store, leases = EventStore(redis_client), Leases(redis_client, holder="w1")
    a, b = await _pending(store, "a"), await _pending(store, "b")
    results = await store.append_many(
        [(a, [f.started(a)]), (b, [f.started(b)])], before=[leases.take_steps(["a"], TTL), []]
    )
    assert [r.status for r in results if isinstance(r, RolloutState)] == [Status.GENERATING] * 2
    view = await leases.read(["a", "b"])
    assert view.left_ms("a") is not None and view.left_ms("a") > 25_000  # type: ignore[operator]
    assert view.left_ms("b") is None  # only the chain that asked
    assert await leases.held_by("w1") == ["a"]


async def test_a_chain_not_sent_sends_no_lease(redis_client: aredis.Redis) -> None:
    store, leases = EventStore(redis_client), Leases(redis_client, holder="w1")
    a = await _pending(store, "a")
    illegal = f.finished(a)  # pending -> done: refused before anything is sent
    [result] = await store.append_many([(a, [illegal])], before=[leases.take_steps(["a"], TTL)])
    assert isinstance(result, TransitionError)
    assert (await leases.read(["a"])).left_ms("a") is None and await leases.held_by("w1") == []


async def test_an_attempt_refused_by_the_store_still_took_its_lease_as_before(
    redis_client: aredis.Redis,
) -> None:
    """As when the lease went first in a round trip of its own: a begin from a stale view is
    refused (another attempt owns the rollout), and the lease it took is left to that attempt
    (the runner never drops a lease after a refusal: ``_NOT_OURS``)."""
    store, leases = EventStore(redis_client), Leases(redis_client, holder="w1")
    a = await _pending(store, "a")
    await store.append(a, f.started(a, worker="w2"))
    [result] = await store.append_many(
        [(a, [f.started(a)])], before=[leases.take_steps(["a"], TTL)]
    )
    assert isinstance(result, AppendRefused)
    assert (await store.head("a")).worker_id == "w2"
    assert (await leases.read(["a"])).left_ms("a") is not None


async def test_a_lease_step_redis_refuses_fails_its_chain_only(
    redis_client: aredis.Redis,
) -> None:
    store = EventStore(redis_client)
    broken = Leases(redis_client, holder="w1")
    await redis_client.set(broken.index_of("a"), "x")  # the lease index, not a sorted set
    a, b = await _pending(store, "a"), await _pending(store, "b")
    results = await store.append_many(
        [(a, [f.started(a)]), (b, [f.started(b)])], before=[broken.take_steps(["a"], TTL), []]
    )
    assert isinstance(results[0], Exception) and "WRONGTYPE" in str(results[0])
    assert isinstance(results[1], RolloutState) and results[1].status is Status.GENERATING
