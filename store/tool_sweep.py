"""The sweep of lost tool calls: claims whose lease lapsed by Redis's clock (their runner died,
stalled or lost its connection) end in ``ToolCallLost``, and the tool's declared effect
decides what follows (``episode_commands.lose_call``): ``idempotent`` and ``restore`` put the
call back on its queue (the next claim carries the last result's revision to restore),
``restart`` fails the episode with ``effect_unverified`` (and, under ``GroupPolicy.GROUP``,
cancels its group's other samples, as any failure does: ``store.group_policy``).

The same pass ends, with ``wall_time``, episodes whose call waited on its queue past their
``max_wall_seconds`` with no runner claiming it (``sweep_wall_time``): a claim, a result and a
worker beginning the next turn check the budget themselves, so this is for a queue nobody
serves in time. It ends a harness-driven episode whose harness made no call for
``SESSION_IDLE_S`` too (``session_end``).

Run by every environment runner (``rollouts env``, ``workers/env/upkeep.py``) and every
worker's reaper (every ``TOOL_SWEEP_S``), so a dead runner's calls are recovered whoever
serves the tools (runners, or a harness over HTTP). Several sweepers at once are safe:
the ``ToolCallLost`` append is fenced by seq, so exactly one sweeper records it, and a lease
is acted on only while it is the one the sweeper saw expire (a heartbeat or a new claim
since changes its expiry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from statemachine import Event, RolloutState, Status, episode_commands, harness_commands
from statemachine.errors import CodecError
from store import defaults, scripts
from store.errors import AppendRefused, RolloutNotFound
from store.event_store import EventStore
from store.group_policy import cancel_siblings
from store.logs import log_event

log = logging.getLogger("rollouts.tool_sweep")


async def sweep_lost_calls(
    store: EventStore,
    *,
    limit: int = 100,
    refusal_grace_s: float = defaults.STORE_REAP_GRACE_S,
    clock: Callable[[], float] = time.time,
) -> list[str]:
    """One pass: the rollouts whose lost call this sweeper recorded. None within the grace
    after Redis last refused a write (``lua/lease_grace.lua``: nobody could renew then)."""
    keys = [store.keys.tool_leases(), store.keys.tool_lease_refusals()]
    _, rows, _ = await scripts.EXPIRED_LEASES(
        store.redis, keys, [limit, int(refusal_grace_s * 1000)]
    )
    lost = []
    for i in range(0, len(rows), 2):
        rid, expiry = rows[i].decode(), int(rows[i + 1])
        try:
            if await _lose(store, rid, expiry, clock):
                lost.append(rid)
        except AppendRefused:
            continue  # another sweeper, or the runner's late result, landed first
    return lost


async def _lose(store: EventStore, rid: str, expiry: int, clock: Callable[[], float]) -> bool:
    leases = store.keys.tool_leases()
    try:
        state = await store.head(rid)
    except RolloutNotFound:
        await scripts.RELEASE_LEASE(store.redis, [leases], [rid, expiry])  # a deleted rollout
        return False
    call = state.pending_call
    if state.status is not Status.RUNNING_TOOL or call is None or not call.live_claim:
        # Nothing is claimed (the index would have dropped the lease with the event that
        # ended the claim): a leftover, removed unless a new claim leased it since.
        await scripts.RELEASE_LEASE(store.redis, [leases], [rid, expiry])
        return False
    score = await store.redis.zscore(leases, rid)
    if score is None or int(score) != expiry:
        # Renewed, or a new claim's since the look. Read after the state: a claim landing
        # after this check changes the seq, and the append below is refused.
        return False
    runner = call.claims[-1].runner_id
    events = episode_commands.lose_call(
        state, call_id=call.call_id, claim=call.live_claim,
        detail=f"lease of runner {runner} expired", now=clock(),
    )  # fmt: skip
    after = await store.append_chain(state, events)
    log_event(
        log, logging.WARNING, "tool_call_lost",
        f"rollout {rid} call {call.call_id} claim {call.live_claim} ({call.name}): lease of "
        f"runner {runner} expired; effect unverified, decided {events[0].decision.value}, "  # type: ignore[attr-defined]
        f"episode {after.status.value}",
        rollout_id=rid, call_id=call.call_id, claim=call.live_claim, lost_runner=runner,
    )  # fmt: skip
    if after.status is Status.FAILED:
        await cancel_siblings(store, after)
    return True


async def sweep_wall_time(
    store: EventStore, *, limit: int = 100, clock: Callable[[], float] = time.time
) -> list[str]:
    """One pass: the episodes awaiting their tool call whose wall time ran out, ended here
    with ``wall_time``. Due entries are picked by this host's clock, and the budget decided
    by it too (``episode_commands.end_on_budget``), as every other check of it is."""
    key = store.keys.episode_deadlines()
    due = await store.redis.zrangebyscore(key, "-inf", int(1000 * clock()), start=0, num=limit)
    ended = []
    for raw in due:
        rid = raw.decode()
        try:
            state = await store.head(rid)
        except RolloutNotFound:
            await store.redis.zrem(key, rid)  # deleted: the entry outlived its episode
            continue
        except CodecError:
            continue  # unreadable: the reaper quarantines it; nobody can act on it here
        if state.terminal:
            # Ended by an append that kept no index (none does today: a safety net); it can
            # never be due again.
            await store.redis.zrem(key, rid)
            continue
        events = episode_commands.end_on_budget(state, clock()) or _idle(state, clock())
        if state.status is not Status.AWAITING_TOOL or not events:
            # Claimed since the look (the claim's step took it off), or not due by this
            # host's clock yet: the next pass looks again.
            continue
        try:
            await store.append_chain(state, events)
        except AppendRefused:
            continue  # a claim, a cancel or another sweeper landed first
        ended.append(rid)
        call = state.pending_call.call_id if state.pending_call else "?"
        why = ("its harness made no call for SESSION_IDLE_S" if state.harness
               else "no runner claimed the call within the episode's wall time")  # fmt: skip
        log_event(
            log, logging.INFO, "wall_time",
            f"rollout {rid}: {why} ({call}); the episode ended ({events[-1].finish_reason})",  # type: ignore[attr-defined]
            rollout_id=rid, call_id=call,
        )  # fmt: skip
    return ended


def _idle(state: RolloutState, now: float) -> list[Event]:
    """``session_end`` for a harness-driven episode whose harness made no call for
    ``SESSION_IDLE_S`` after its last turn ended; nothing otherwise."""
    call = state.pending_call
    if not state.harness or call is None or now < call.requested_at + defaults.SESSION_IDLE_S:
        return []
    return harness_commands.end_session(state)
