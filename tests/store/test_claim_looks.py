"""A runner's looks at calls, on fakeredis and a real redis-server: a ring names the episode
that rang and is tried before the queue, a report starts from the state its claim left (no
read when nothing landed since, and fenced when something did), a look at a call another runner
claimed stops at the snapshot's head, and an episode's head leaves its token records undecoded."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from statemachine import CorruptRecord, Status
from statemachine.events import Cancelled
from store import EventStore
from store.environment import EnvironmentClient
from store.errors import ClaimLost
from store.tool_sweep import sweep_lost_calls
from tests import factories as f
from tests.damage import damage_event
from tests.store.conftest import waiting


def _count(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> list[Any]:
    """Record each call of ``obj.name`` (an async method), which still runs."""
    calls: list[Any] = []
    real = getattr(obj, name)

    async def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return await real(*args, **kw)

    monkeypatch.setattr(obj, name, counted)
    return calls


async def test_a_ring_names_the_episode_oldest_first_and_keeps_the_newest_64(
    env: EnvironmentClient,
) -> None:
    for rid in ("a", "b", "c"):
        await waiting(env, rid)
    assert await env.wait(["other", "default"], 1.0) == ("default", "a")
    assert await env.wait(["default"], 1.0) == ("default", "b")
    assert await env.wait(["default"], 1.0) == ("default", "c")
    assert await env.wait(["default"], 0.05) is None
    for i in range(70):
        await waiting(env, f"e{i}", env_queue="box")
    bell = await env.store.redis.lrange(env.store.keys.env_bell("box"), 0, -1)
    assert bell == [f"e{i}".encode() for i in range(6, 70)]


async def test_a_claim_from_a_ring_takes_that_call_without_looking_at_the_queue(
    env: EnvironmentClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await waiting(env, "old")
    await waiting(env, "new")
    looks = _count(monkeypatch, env.store.redis, "zrange")
    claim = await env.claim("default", "r1", first="new")
    assert claim is not None and claim.rollout_id == "new" and looks == []
    # A ring for a call claimed since: the queue's oldest instead.
    claim = await env.claim("default", "r2", first="new")
    assert claim is not None and claim.rollout_id == "old" and len(looks) == 1
    # A ring for a rollout that is gone, or not a rollout id: the queue's oldest instead.
    for i, ring in enumerate(("gone", "", "a:b")):
        await waiting(env, f"next{i}")
        claim = await env.claim("default", "r3", first=ring)
        assert claim is not None and claim.rollout_id == f"next{i}"


async def test_a_ring_naming_an_episode_of_another_queue_claims_nothing_of_it(
    env: EnvironmentClient,
) -> None:
    await waiting(env, "boxed", env_queue="box")
    assert await env.claim("default", "r1", first="boxed") is None
    assert (await env.store.head("boxed")).status is Status.AWAITING_TOOL
    claim = await env.claim("box", "r1", first="boxed")
    assert claim is not None and claim.rollout_id == "boxed"


async def test_a_blocking_claim_takes_the_call_its_ring_names(env: EnvironmentClient) -> None:
    waiter = asyncio.create_task(env.claim("default", "r1", timeout_s=5.0))
    await asyncio.sleep(0.1)
    await waiting(env, "late")
    claim = await asyncio.wait_for(waiter, 5.0)
    assert claim is not None and claim.rollout_id == "late"
    assert await env.store.redis.llen(env.store.keys.env_bell("default")) == 0


async def test_a_look_at_a_claimed_call_reads_only_the_head(
    env: EnvironmentClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await waiting(env, "ep")
    assert await env.claim("default", "r1") is not None
    reads = _count(monkeypatch, env.store.redis, "xrange")
    assert await env.store.head_at("ep", Status.AWAITING_TOOL) is None
    assert reads == []  # the tool records are never read for it
    head = await env.store.head_at("ep", Status.RUNNING_TOOL)
    assert head is not None and head == await env.store.head("ep") and len(reads) == 2


async def test_a_report_starts_from_the_state_its_claim_left(
    env: EnvironmentClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await waiting(env, "ep")
    claim = await env.claim("default", "r1")
    assert claim is not None and claim.state is not None
    assert claim.state.status is Status.RUNNING_TOOL
    heads = _count(monkeypatch, env.store, "head")
    after = await env.record_result(claim, np.array([5, 6], dtype=np.int32), seconds=0.1)
    assert after.status is Status.NEXT_TURN and heads == []
    loaded = await env.store.load("ep")
    assert loaded.seq == after.seq and loaded.calls == after.calls
    # Reported again from the same claim: its state is stale now; the append is refused and
    # the look that follows finds the claim ended. Nothing is written.
    with pytest.raises(ClaimLost):
        await env.record_result(claim, np.array([5, 6], dtype=np.int32))
    assert len(heads) == 1 and (await env.store.load("ep")).seq == after.seq


@pytest.mark.parametrize("landed", ["cancel", "lost"])
async def test_a_report_whose_claim_ended_since_is_refused_and_writes_nothing(
    env: EnvironmentClient, landed: str
) -> None:
    await waiting(env, "ep")
    claim = await env.claim("default", "r1", lease_s=0.05)
    assert claim is not None
    if landed == "cancel":
        s = await env.store.head("ep")
        await env.store.append(s, Cancelled(rollout_id="ep", seq=s.seq + 1, reason="trainer"))
    else:
        await asyncio.sleep(0.15)
        assert await sweep_lost_calls(env.store) == ["ep"]
    seq = (await env.store.head("ep")).seq
    with pytest.raises(ClaimLost):
        await env.record_result(claim, np.array([5], dtype=np.int32))
    with pytest.raises(ClaimLost):
        await env.record_failure(claim, f.ToolFailure.ENV_ERROR, "late")
    assert (await env.store.head("ep")).seq == seq


async def _next_turn(env: EnvironmentClient) -> None:
    s = await env.store.head("ep")
    s = await env.store.append(s, f.resumed(s))
    s = await env.store.append(s, f.tokens(s, n=2))
    await env.store.append(s, f.requested(s))


async def test_a_claim_after_a_report_reads_only_what_came_since(
    env: EnvironmentClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client holds the episode as its report left it: the next call's claim reads the
    entries since (the next turn's), not the head and every tool record again; whoever
    reported in between (folded in, checked event by event), the claim is the one a fresh
    look gives. A client that holds nothing looks at the head."""
    await waiting(env, "ep", max_turns=12)
    other = EnvironmentClient(env.store, env.connection)
    for reporter in (env, other, other, env):
        claim = await reporter.claim("default", "r1")
        assert claim is not None
        await reporter.record_result(claim, np.array([5, 6], dtype=np.int32))
        await _next_turn(env)
        fresh = await env.store.head("ep")
        heads = _count(monkeypatch, env.store, "head_at")
        claim = await env.claim("default", "r2")
        assert claim is not None and claim.state is not None and heads == []
        assert claim.call_id == fresh.calls[-1].call_id and claim.state.seq == fresh.seq + 1
        monkeypatch.undo()
        assert claim.state == await env.store.head("ep")  # a head (no chunks), as a look's
        await env.record_result(claim, np.array([7], dtype=np.int32))
        await _next_turn(env)
    heads = _count(monkeypatch, env.store, "head_at")
    third = EnvironmentClient(env.store, env.connection)
    claim = await third.claim("default", "r3")
    assert claim is not None and heads == [("ep", Status.AWAITING_TOOL)]


async def test_an_episodes_head_leaves_its_token_records_undecoded(store: EventStore) -> None:
    s = await store.append(None, f.episode_submitted("ep"))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=3))
    s = await store.append(s, f.requested(s))
    await damage_event(store.redis, store, "ep", 3)  # its token record
    head = await store.head("ep")
    assert head.seq == s.seq and head.calls == s.calls and head.chunks == ()
    with pytest.raises(CorruptRecord):
        await store.load("ep")  # the read that takes the tokens refuses the damage
    await damage_event(store.redis, store, "ep", 4)  # its tool record now
    with pytest.raises(CorruptRecord):
        await store.head("ep")
