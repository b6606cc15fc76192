"""Leases on fakeredis and a real redis-server: renewals never resurrect or shorten a lease,
expired ones come oldest first, and a reaper's release or quarantine loses to a renewal.
Expiries are unix ms by Redis's clock (tests/store/test_one_clock.py: whatever the host's)."""

from __future__ import annotations

import pytest
import redis.asyncio as aredis

from store.leases import Leases

TTL = 30.0


@pytest.fixture
def leases(redis_client: aredis.Redis) -> Leases:
    return Leases(redis_client)


async def now_ms(leases: Leases) -> int:
    """Redis's clock, which stamps and judges every lease."""
    return (await leases.read()).now_ms


async def test_take_sets_an_expiry_ttl_from_now(leases: Leases) -> None:
    before = await now_ms(leases)
    await leases.take("r1", TTL)
    expiry = await leases.expiry("r1")
    assert expiry is not None and before + 30_000 <= expiry <= await now_ms(leases) + 30_000
    assert await leases.expiry("unknown") is None
    assert await leases.left_ms("unknown") is None


async def test_take_many_takes_each_and_lists_them_under_their_holder(
    redis_client: aredis.Redis,
) -> None:
    mine = Leases(redis_client, holder="w1")
    ids = [f"r{i}" for i in range(2500)]  # more than one ZADD chunk of the script (1000)
    await mine.take_many(ids, TTL)
    view = await mine.read(ids)
    assert view.held == 2500 and view.expired == 0
    assert {view.expiries[rid] for rid in ids} == {view.expiries["r0"]}  # one stamp for all
    assert await mine.held_by("w1") == sorted(ids)
    await mine.renew(ids, TTL + 1)
    renewed = await mine.read(ids)
    assert {renewed.expiries[rid] for rid in ids} == {renewed.expiries["r0"]}
    assert renewed.expiries["r0"] > view.expiries["r0"]  # type: ignore[operator]
    await mine.drop_many(ids)
    assert (await mine.read()).held == 0 and await mine.held_by("w1") == []


async def test_renew_extends_only_leases_still_held(leases: Leases) -> None:
    await leases.take("held", 1.0)
    first = await leases.expiry("held")
    await leases.renew(["held", "reaped"], TTL)  # "reaped": a reaper removed it meanwhile
    renewed = await leases.expiry("held")
    assert first is not None and renewed is not None and renewed >= first + 28_000
    assert await leases.expiry("reaped") is None  # XX: a renewal never resurrects a lease
    now = await leases.renew([], TTL)  # nothing held: only Redis's clock is read
    assert abs(now - await now_ms(leases)) < 1_000


async def test_renew_never_moves_a_lease_backwards(leases: Leases) -> None:
    await leases.take("r1", TTL)
    long = await leases.expiry("r1")
    await leases.renew(["r1"], 1.0)  # GT: a shorter renewal (e.g. a late one) is ignored
    assert await leases.expiry("r1") == long


async def test_expired_lists_past_expiries_oldest_first_up_to_a_limit(leases: Leases) -> None:
    now = await now_ms(leases)
    await leases.redis.zadd(
        leases.key, {"newer": now - 1_000, "oldest": now - 5_000, "middle": now - 3_000}
    )
    await leases.take("live", TTL)
    assert await leases.expired() == [
        ("oldest", now - 5_000),
        ("middle", now - 3_000),
        ("newer", now - 1_000),
    ]
    assert [rid for rid, _ in await leases.expired(limit=2)] == ["oldest", "middle"]


async def test_drop_removes_a_lease(leases: Leases) -> None:
    await leases.take("r1", TTL)
    await leases.drop("r1")
    await leases.drop("r1")  # idempotent
    assert await leases.expiry("r1") is None


async def test_release_if_unchanged_loses_to_a_renewal(leases: Leases) -> None:
    seen = await now_ms(leases) - 1_000
    await leases.redis.zadd(leases.key, {"dead": seen, "woke": seen})
    await leases.renew(["woke"], TTL)  # its worker renewed after the reaper looked
    assert await leases.release_if_unchanged("dead", seen)
    assert not await leases.release_if_unchanged("woke", seen)
    assert await leases.expiry("dead") is None and await leases.expiry("woke") is not None
    assert not await leases.release_if_unchanged("dead", seen)  # already gone


async def test_quarantine_moves_the_lease_aside_with_its_reason(leases: Leases) -> None:
    seen = await now_ms(leases) - 1_000
    await leases.redis.zadd(leases.key, {"bad": seen, "woke": seen})
    await leases.renew(["woke"], TTL)
    assert await leases.quarantine("bad", seen, "undecodable event at seq 3")
    assert not await leases.quarantine("woke", seen, "renewed meanwhile")
    assert not await leases.quarantine("gone", seen, "no lease")
    assert await leases.quarantined() == {"bad": "undecodable event at seq 3"}
    assert await leases.expiry("bad") is None and await leases.expiry("woke") is not None
