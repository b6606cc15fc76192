"""The environment side of episodes: whoever runs the tools claims the pending calls of an
environment queue, heartbeats them, and records each one's result or failure.

Every write is an event appended through the fenced store, as a generation worker's are: a
claim is ``ToolCallClaimed`` (claim number = the previous + 1, fenced by seq, so of two
runners at once exactly one gets the call), and a result or failure names its claim, which the
domain accepts only while it is the call's live claim, so a zombie runner's late report is
refused (``ClaimLost``) with nothing written. The queue itself is an index kept by those
appends (``store.tool_index``); a claim never pops it: its entry goes in the transaction that
records the claim, so a runner that dies between looking and claiming strands nothing.

A claim is leased by Redis's clock like a generation attempt (``lua/tool_call_index.lua``
takes the lease with the claim; ``lua/tool_heartbeat.lua`` renews it); a lease left to lapse
is the sweep's (``store.tool_sweep``). A recorded result makes the next turn runnable: its
generation job is pushed in the same transaction (``lua/turn_job.lua``), as a resume is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis import Redis as SyncRedis

from statemachine import RolloutState, Status, apply, codec, episode_commands
from statemachine.episode import ToolEffect
from statemachine.errors import CodecError
from statemachine.events import Event
from statemachine.status import ToolFailure
from statemachine.tool_calls import ClaimEnd
from store import defaults, scripts
from store.errors import (
    AppendRefused,
    ClaimLost,
    InvalidRolloutId,
    RolloutNotFound,
    SequenceConflict,
)
from store.event_store import EventStore
from store.group_policy import cancel_siblings
from store.since import Held, read_since
from store.tool_index import claim_fence
from store.turn_jobs import TurnJobs

# Entries of a queue looked at per claim, oldest first: more than one, so that a runner that
# loses the race for the first (another runner claimed it) tries the next in the same look.
CLAIM_SCAN = 16
# Episodes an EnvironmentClient holds as its last report on each left them (``_held``): a
# head state each (no token data), its calls' observations shared with their events.
HOLD = 1024
# Looks at a call before a report gives up on SequenceConflict: each means another event of
# the episode landed between the read and the append (a trainer's cancel, the sweep), and the
# next look decides again, so more than a few in a row is a bug worth raising.
REPORT_TRIES = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallClaim:
    """A call a runner holds: what to run, and its fence (``rollout_id``, ``call_id``,
    ``claim``) for every report about it. ``idempotency_key`` is the same for every claim
    of the call. ``env_handle``/``env_revision`` are those recorded with the episode's last
    result ("" before any); ``restore`` says the environment must go back to that revision
    before running the call: an earlier claim of it was lost with its effect unverified and
    the tool declares ``restore``."""

    rollout_id: str
    call_id: str
    claim: int
    runner_id: str
    name: str
    arguments: str
    idempotency_key: str
    effect: ToolEffect
    env_handle: str
    env_revision: str
    restore: bool
    # The episode as this claim left it: a report made with it as its first look saves reading
    # the episode again (two round trips, its tool records decoded: a claim's report took
    # 11-14 ms with them on bench_episodes, 3-4 without, medians measured). The append is
    # fenced by its seq, so if anything landed since, the report is refused with nothing
    # written and looks again (``EnvironmentClient._report``).
    state: RolloutState | None = field(default=None, compare=False, repr=False)


class CallFence(Protocol):
    """What a report about a call names: the call, and the claim it is made under. A
    ``ToolCallClaim`` is one; so is what a runner over HTTP sends back (``store.api``)."""

    @property
    def rollout_id(self) -> str: ...
    @property
    def call_id(self) -> str: ...
    @property
    def claim(self) -> int: ...


def claim_of(state: RolloutState) -> ToolCallClaim:
    """The claim ``state`` (just claimed) hands its runner."""
    call = state.pending_call
    assert call is not None and call.live_claim and state.request.episode is not None
    last = next((c.result for c in reversed(state.calls) if c.result is not None), None)
    lost = [c for c in call.claims if c.end is ClaimEnd.LOST]
    return ToolCallClaim(
        rollout_id=state.rollout_id,
        call_id=call.call_id,
        claim=call.live_claim,
        runner_id=call.claims[-1].runner_id,
        name=call.name,
        arguments=call.arguments,
        idempotency_key=call.idempotency_key,
        effect=state.request.episode.effect_of(call.name),
        env_handle="" if last is None else last.env_handle,
        env_revision="" if last is None else last.env_revision,
        restore=any(c.decision is ToolEffect.RESTORE for c in lost),
        state=state,
    )


class EnvironmentClient:
    """``store``: the event store (its Redis holds the queues); ``connection``: a synchronous
    client of the same Redis, for rq's job templates (``store.queue.JobWriter``); ``clock``:
    the host's, for the wall-time budget only (leases are judged by Redis's)."""

    def __init__(
        self,
        store: EventStore,
        connection: SyncRedis,
        *,
        lease_s: float = defaults.TOOL_LEASE_TTL_S,
        retries: int = defaults.TOOL_RETRIES,
        clock: Callable[[], float] = time.time,
        queue_apart: bool = False,
    ) -> None:
        """``connection``: the queue's Redis (rq's, synchronous); ``queue_apart``: it is not
        the store's (``store.queue_redis``)."""
        self.store = store
        self.connection = connection
        self.lease_s = lease_s
        self.retries = retries
        self.clock = clock
        self._jobs = TurnJobs(connection, store.keys, apart=queue_apart)
        # Episodes as this client's last report left them (oldest first, at most ``HOLD``):
        # a claim of their next call reads only the log's entries since (``store.since``).
        self._held: dict[str, Held] = {}

    async def claim(
        self,
        queue: str,
        runner_id: str,
        lease_s: float | None = None,
        timeout_s: float = 0.0,
        *,
        first: str | None = None,
    ) -> ToolCallClaim | None:
        """The oldest claimable call of environment queue ``queue``, claimed for ``runner_id``
        and leased for ``lease_s``; None if there is none, after waiting up to ``timeout_s``.
        ``first``: an episode to try before the queue's oldest (a ring of its doorbell,
        ``wait``), which saves the look at the queue when it is claimable."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = await self._claim_once(queue, runner_id, lease_s or self.lease_s, first)
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            rung = await self.wait([queue], left)
            first = None if rung is None else rung[1]

    async def wait(self, queues: Sequence[str], timeout_s: float) -> tuple[str, str] | None:
        """Until a call may have become claimable on one of ``queues`` (its doorbell rang:
        the append that makes a call claimable rings it, with the episode's id), or
        ``TOOL_CLAIM_POLL_S`` (at most ``timeout_s``) passed; the ring taken, as (queue, the
        episode's id), or None. A ring another runner took, or one lost with a restarted
        Redis, costs a look, never a call. Measured on the episodes benchmark: polling every
        50 ms instead left a call waiting 25 ms (median) per turn."""
        # At least 10 ms: Redis reads a timeout that rounds to 0 ms as "block forever".
        wait = max(0.01, min(defaults.TOOL_CLAIM_POLL_S, timeout_s))
        bells = {self.store.keys.env_bell(q): q for q in queues}
        rung = await self.store.redis.blpop(list(bells), timeout=wait)  # type: ignore[misc]  # async client
        if rung is None:
            return None
        bell, rid = rung
        return bells[bell.decode()], rid.decode()

    async def _claim_once(
        self, queue: str, runner_id: str, lease_s: float, first: str | None = None
    ) -> ToolCallClaim | None:
        if first is not None:
            # A ring names the episode that rang: one look at it, none at the queue (the look
            # at the queue took 2-5 ms of a claim on bench_episodes' loaded 2-core host).
            try:
                got = await self._claim_one(queue, first, runner_id, lease_s)
            except InvalidRolloutId:
                got = None  # not a ring ours wrote (anyone may push onto a list): no hint
            if got is not None:
                return got
        key = self.store.keys.env_queue(queue)
        for raw in await self.store.redis.zrange(key, 0, CLAIM_SCAN - 1):
            rid = raw.decode()
            if rid != first:
                got = await self._claim_one(queue, rid, runner_id, lease_s)
                if got is not None:
                    return got
        return None

    async def _claim_one(
        self, queue: str, rid: str, runner_id: str, lease_s: float
    ) -> ToolCallClaim | None:
        """``rid``'s pending call claimed, or None if it has none claimable on ``queue``."""
        try:
            state = await self._look_at(rid)
        except RolloutNotFound:
            # Deleted under its entry (an entry outlives no ended episode: the append
            # that ended it took it off): nothing to claim, ever.
            await self.store.redis.zrem(self.store.keys.env_queue(queue), rid)
            return None
        except CodecError:
            # Unreadable: no runner could act on it; the reaper quarantines its rollout.
            return None
        if state is None:
            return None  # claimed by another runner since the look (or the ring)
        episode = state.request.episode
        if episode is None or episode.env_queue != queue:
            return None  # a ring on this queue's bell naming an episode of another queue
        try:
            ended = episode_commands.end_on_budget(state, self.clock())
            if ended:
                # Its tool time or wall time is spent: the episode ends instead of
                # running the call (which takes it off the queue).
                await self.store.append_chain(state, ended)
                return None
            claimed = episode_commands.claim_call(state, runner_id)
            after = await self.store.append_chain(state, [claimed], tool_lease_s=lease_s)
        except AppendRefused:
            return None  # another runner (or event) got there first: the next entry
        return claim_of(after)

    async def _look_at(self, rid: str) -> RolloutState | None:
        """``rid``'s head if it awaits its tool, else None: from the state this client's last
        report on it left when that is still the log's (one round trip, the entries since
        decoded), else from a head read (two, its tool records decoded)."""
        held = self._held.pop(rid, None)
        if held is not None:
            [state] = await read_since(self.store, [held])
            if state is not None:
                awaiting = state.status is Status.AWAITING_TOOL
                return state.evolve(chunks=()) if awaiting else None  # a head has no chunks
        return await self.store.head_at(rid, Status.AWAITING_TOOL)

    def _hold(self, state: RolloutState, record: bytes) -> None:
        self._held.pop(state.rollout_id, None)
        self._held[state.rollout_id] = Held(state, record)
        while len(self._held) > HOLD:
            del self._held[next(iter(self._held))]  # the oldest: served elsewhere, or ended

    async def heartbeat(
        self, claims: Sequence[CallFence], lease_s: float | None = None
    ) -> list[bool]:
        """Renew the leases of ``claims`` in one round trip; for each, whether it is still
        live (False: lost, its runner should stop and drop it)."""
        if not claims:
            return []
        keys = self.store.keys
        script_keys = [keys.tool_leases(), *(keys.snapshot(c.rollout_id) for c in claims)]
        args: list[scripts.Arg] = [int(1000 * (lease_s or self.lease_s))]
        for c in claims:
            args += [c.rollout_id, claim_fence(c.call_id, c.claim)]
        _, live = await scripts.TOOL_HEARTBEAT(self.store.redis, script_keys, args)
        return [bool(x) for x in live]

    async def record_result(
        self,
        claim: CallFence,
        observation_token_ids: Any,
        *,
        env_handle: str = "",
        env_revision: str = "",
        seconds: float = 0.0,
    ) -> RolloutState:
        """Record the claim's result (``ClaimLost`` if it is not live) and, unless a budget
        ends the episode there, push its next turn's generation job in the same step."""

        def events(state: RolloutState) -> list[Event]:
            return episode_commands.record_result(
                state, call_id=claim.call_id, claim=claim.claim,
                observation_token_ids=observation_token_ids, seconds=seconds,
                env_handle=env_handle, env_revision=env_revision, now=self.clock(),
            )  # fmt: skip

        return await self._report(claim, events)

    async def record_failure(
        self, claim: CallFence, failure: ToolFailure, error: str = "", seconds: float = 0.0
    ) -> RolloutState:
        """Record that the claim failed (``ClaimLost`` if it is not live): ``env_error`` makes
        the call claimable again within its retries; ``env_fatal``, or an ``env_error``
        beyond them, fails the episode (its completion is delivered like any failure's)."""

        def events(state: RolloutState) -> list[Event]:
            return episode_commands.fail_call(
                state, call_id=claim.call_id, claim=claim.claim, failure=ToolFailure(failure),
                error=error, retries=self.retries, seconds=seconds, now=self.clock(),
            )  # fmt: skip

        after = await self._report(claim, events)
        if after.status is Status.FAILED:
            # As any failure: under GroupPolicy.GROUP its group's other samples are cancelled.
            await cancel_siblings(self.store, after)
        return after

    async def _report(
        self, claim: CallFence, events: Callable[[RolloutState], list[Event]]
    ) -> RolloutState:
        # The state the claim left, when it is a claim of ours: a first look that costs nothing.
        known = claim.state if isinstance(claim, ToolCallClaim) else None
        for _ in range(REPORT_TRIES + (known is not None)):
            if known is not None:
                state, known = known, None
            else:
                state = await self._look(claim)
            _check_live(state, claim)
            chain = events(state)
            then = await self._turn_job(state, chain)
            try:
                after = await self.store.append_chain(state, chain, then=then)
            except BaseException as exc:
                self._jobs.forget(claim.rollout_id)  # the queue apart: no job to push
                if isinstance(exc, SequenceConflict):
                    continue  # another event landed since the read: look at the call again
                raise
            # The queue apart (store.queue_redis): the next turn's job, once its result landed.
            await self._jobs.push(self.store.redis, claim.rollout_id)
            if not after.terminal:
                self._hold(after, codec.encode(chain[-1]))
            return after
        raise SequenceConflict(claim.rollout_id, 0, -1)

    async def _look(self, claim: CallFence) -> RolloutState:
        try:
            return await self.store.head(claim.rollout_id)
        except RolloutNotFound:
            why = "no such rollout (acknowledged, or expired)"
            raise ClaimLost(claim.rollout_id, claim.call_id, claim.claim, why) from None

    async def _turn_job(self, state: RolloutState, chain: list[Event]) -> list[scripts.Step]:
        """The step that pushes the next turn's generation job, if ``chain`` leaves the
        episode at ``next_turn`` (none if a budget ends it there)."""
        after = state
        for event in chain:
            after = apply(after, event)
        return await self._jobs.step(after)


def _check_live(state: RolloutState, claim: CallFence) -> None:
    call = state.pending_call
    if state.status is not Status.RUNNING_TOOL or call is None:
        why = f"the episode is {state.status.value}, no claim is live"
    elif call.call_id != claim.call_id or call.live_claim != claim.claim:
        why = f"the live claim is {call.call_id!r} claim {call.live_claim}"
    else:
        return
    raise ClaimLost(claim.rollout_id, claim.call_id, claim.claim, why)
