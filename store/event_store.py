"""The fenced event store: one log and one snapshot per rollout, appended to atomically.

asyncio, not sync: the workers (one event loop driving many rollouts on one engine) and the
HTTP API are asyncio, and a sync store would need a thread per in-flight rollout. A trainer that
is not async uses the client's sync facade, which runs this store on a private loop.

Write path: ``append`` folds the event onto the caller's view of the state in Python (an
illegal event raises the domain's ``TransitionError`` before anything is sent), then one
MULTI/EXEC checks the sequence number and the fencing attempt (``lua/append.lua``) and writes
the log entry and the new snapshot together. The record itself never passes through Lua, which
would hash every byte of it: it goes just before the script, as a plain XADD that the stream's
own ids refuse for a seq already taken, and that the script undoes if it refuses the event, in
the same transaction (so no reader ever sees it). The caller's view may be stale: the script
then refuses with ``SequenceConflict`` or ``StaleAttempt`` and nothing is written. A retried
append whose record is already stored at that sequence number succeeds without writing again,
which is what makes a blind retry after a lost reply safe (the script reports the sequence
number taken, and the stored record is compared with the caller's here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from statemachine import (
    Event,
    FailureClass,
    RolloutState,
    Status,
    TokensAppended,
    apply,
    codec,
    commands,
    fence_of,
)
from statemachine.episode_events import ToolEvent
from statemachine.errors import CorruptRecord, TransitionError
from store import cluster_appends, defaults, scripts
from store.append_replies import checked, refusal, resolve_taken
from store.errors import (
    RolloutNotFound,
)
from store.keys import Keys
from store.log_reads import (
    COMPLETION,
    FIRST,
    HEAD,
    JOB,
    STATUS,
    decode_entries,
    read_head,
    submitted_event,
    submitted_record,
    tool_events,
)
from store.prepared import _Prepared
from store.tool_index import index_call

__all__ = [
    "COMPLETION",
    "FIRST",
    "HEAD",
    "JOB",
    "STATUS",
    "EventStore",
    "decode_entries",
    "read_head",
    "submitted_record",
]


class EventStore:
    def __init__(
        self, client: Redis | RedisCluster, keys: Keys | None = None, *, replicas_acked: int = 0
    ) -> None:
        """``client``: one Redis, or a Redis Cluster (``store.cluster_appends``).
        ``replicas_acked``: an append counts as stored once that many replicas of its master
        confirm it (``WAIT``), else it raises ``ReplicasNotAcked`` (0: once its master has)."""
        # A RedisCluster serves every command the store sends outside the cluster's own paths.
        self.redis = cast(Redis, client)
        # Records are binary: a client that decodes responses would mangle them.
        if self.redis.get_encoder().decode_responses:  # type: ignore[no-untyped-call]
            raise ValueError("EventStore needs a Redis client with decode_responses=False")
        self.on_cluster = client if isinstance(client, RedisCluster) else None
        self.cluster = self.on_cluster is not None
        self.replicas_acked = replicas_acked
        # On a cluster a group's rollouts share a slot (``Keys.grouped``).
        self.keys = keys or (
            Keys(grouped=True, lease_shards=defaults.CLUSTER_LEASE_SHARDS)
            if self.cluster
            else Keys()
        )

    # -- writes -------------------------------------------------------------------------------
    async def append(self, state: RolloutState | None, event: Event) -> RolloutState:
        """Append ``event`` to the rollout whose current state the caller holds as ``state``
        (None for a new rollout) and return the state after it."""
        p = self.prepare(state, event)
        (reply,), _ = await self._run([p])
        error = refusal(reply, p.event)
        if error is not None:
            raise error
        return p.state

    async def append_chain(
        self,
        state: RolloutState,
        events: Sequence[Event],
        *,
        then: Sequence[scripts.Step] = (),
        tool_lease_s: float | None = None,
    ) -> RolloutState:
        """Append a chain of one rollout's events (as ``append_many`` does one chain) with the
        caller's ``then`` steps after them in the same transaction; the state after the last
        event, or the first refusal raised (none of the chain is written after it)."""
        prepared: list[_Prepared] = []
        after: RolloutState | None = state
        for event in events:
            p = self.prepare(after, event, after=prepared[-1].head if prepared else None)
            prepared.append(p)
            after = p.state
        replies, _ = await self._run(prepared, then=then, tool_lease_s=tool_lease_s)
        for p, reply in zip(prepared, replies, strict=True):
            error = refusal(reply, p.event)
            if error is not None:
                raise error
        return prepared[-1].state

    async def append_many(
        self,
        chains: Sequence[tuple[RolloutState | None, Sequence[Event]]],
        *,
        before: Sequence[Sequence[scripts.Step]] = (),
    ) -> list[RolloutState | Exception]:
        """Append chains of events, each chain on one rollout from the state its caller holds,
        all in one round trip (a worker's checkpoint of every rollout it runs).

        Each chain succeeds or fails on its own: its result is the state after its last event,
        or the first refusal (an illegal event is never sent; after a refusal the rest of the
        chain is refused too: lua/append.lua accepts a chain's later event only over the head
        its predecessor wrote).

        ``before``: per chain (when given, one entry each), steps that go first in the same
        transaction if the chain is sent (a lease taken with the event that opens an attempt:
        ``Leases.take_steps``). A step Redis refuses is its chain's result (its events may
        have landed: the caller treats the chain as failed and its rollout as one to recover).
        """
        results: list[RolloutState | Exception] = []
        calls: list[_Prepared] = []
        spans: list[tuple[int, int]] = []
        leading: list[scripts.Step] = []
        owners: list[int] = []  # the chain of each step of ``leading``
        for k, (state, events) in enumerate(chains):
            start = len(calls)
            try:
                for event in events:
                    # A later event of the chain holds the head its predecessor writes, so
                    # that it is refused unless that one was accepted (lua/append.lua).
                    after = calls[-1].head if len(calls) > start else None
                    p = self.prepare(state, event, after=after)
                    calls.append(p)
                    state = p.state
            except TransitionError as exc:
                del calls[start:]
                results.append(exc)
                spans.append((start, start))
                continue
            if state is None:
                raise ValueError("an empty chain needs a state")
            results.append(state)
            spans.append((start, len(calls)))
            if before and before[k]:
                leading += before[k]
                owners += [k] * len(before[k])
        replies, first = await self._run(calls, before=leading) if calls else ([], [])
        for k, reply in zip(owners, first, strict=True):
            if isinstance(reply, Exception) and not isinstance(results[k], Exception):
                results[k] = reply
        for i, (start, end) in enumerate(spans):
            for p, reply in zip(calls[start:end], replies[start:end], strict=True):
                error = refusal(reply, p.event)
                if error is not None and not isinstance(results[i], Exception):
                    results[i] = error
                    break
        return results

    async def _run(
        self,
        calls: Sequence[_Prepared],
        *,
        then: Sequence[scripts.Step] = (),
        tool_lease_s: float | None = None,
        before: Sequence[scripts.Step] = (),
    ) -> tuple[list[Any], list[Any]]:
        """Every append of ``calls`` in one MULTI/EXEC (one round trip), in order; the script's
        reply for each, with "taken" resolved into "dup" or the refusal, and the replies of
        ``before``, steps that run first. ``then``: steps of the caller's that run last in the
        same transaction (a script that acts only if the appends landed, as
        lua/turn_job.lua); ``tool_lease_s``: the lease of a tool call claimed here."""
        if self.cluster:
            cluster_appends.check_supported(calls, [*before, *then])
            return await self._run_on_cluster(calls), []
        # A rollout's n-th event of the batch goes in the n-th script call (lua/append.lua
        # takes at most one event per rollout per call), each call preceded by its records.
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, p in enumerate(calls):
            n = seen.get(p.event.rollout_id, 0)
            seen[p.event.rollout_id] = n + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(i)
        steps: list[scripts.Step] = list(before)
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(calls)  # step, index, XADD step
        lease_ms = int(1000 * (tool_lease_s or defaults.TOOL_LEASE_TTL_S))
        for members in rounds:
            keys: list[str] = [calls[members[0]].keys[3]]  # the counters, one for all
            args: list[int | str | bytes] = [""]  # completions to their batches' streams
            xadds = []
            for i in members:
                keys += calls[i].script_keys()
                args += calls[i].script_args()
                xadds.append(len(steps))
                steps += calls[i].ahead()
            for j, i in enumerate(members):
                where[i] = (len(steps), j, xadds[j])
            steps.append(scripts.Call(scripts.APPEND, keys, args))
            # An episode's call goes on (or off) its environment queue in the same transaction
            # (store/tool_index.py); nothing at all for a round of plain rollouts.
            index = index_call(self.keys, [calls[i] for i in members], lease_ms)
            if index is not None:
                steps.append(index)
        replies = await scripts.transaction(
            self.redis, [*steps, *then], replicas=self.replicas_acked
        )
        out: list[Any] = []
        for p, (call_step, j, xadd) in zip(calls, where, strict=True):
            batch = replies[call_step]
            if isinstance(batch, Exception):
                raise batch
            out.append(checked(p, batch[j].split(), replies[xadd]))  # lua/append.lua's words
        return await resolve_taken(self.redis, calls, out), replies[: len(before)]

    async def _run_on_cluster(self, calls: Sequence[_Prepared]) -> list[Any]:
        """``_run`` on Redis Cluster (``store.cluster_appends``)."""
        assert self.on_cluster is not None
        sent = await cluster_appends.run(self.on_cluster, self.keys, self.replicas_acked, calls)
        out = [
            r if isinstance(r, Exception) else checked(p, *r)
            for p, r in zip(calls, sent, strict=True)
        ]
        out = await resolve_taken(self.redis, calls, out)
        await cluster_appends.deliver_ended(self.on_cluster, self.keys, self.replicas_acked,
                                            calls, out)  # fmt: skip
        return out

    def prepare(
        self, state: RolloutState | None, event: Event, *, after: bytes | None = None
    ) -> _Prepared:
        """The checked event with the keys and arguments of its append (no I/O): for callers
        that put appends into a transaction of their own (``store.batches``). ``after``: for
        a later event of a chain, the head its predecessor writes (``_Prepared.head``)."""
        new_state = apply(state, event)
        fence = fence_of(event)
        rid = event.rollout_id
        batch = new_state.membership.batch_id
        return _Prepared(
            event=event,
            state=new_state,
            keys=(
                *self.keys.rollout(rid),
                self.keys.completions(batch),
                self.keys.stats(),
                self.keys.batch(batch),
            ),
            args=(
                event.seq,
                "" if fence is None else str(fence),
                codec.encode(event),
                codec.encode_snapshot(new_state),
                new_state.live_attempt,
                new_state.status.value,
                len(event) if isinstance(event, TokensAppended) else 0,
                rid,
                b"" if after is None else after,
            ),
        )

    # -- reads --------------------------------------------------------------------------------
    async def load(self, rollout_id: str) -> RolloutState:
        """The current state, from the snapshot; token data from the log's token records."""
        if self.cluster:
            result = (await self.load_many([rollout_id]))[0]
            if isinstance(result, Exception):
                raise result
            return result
        async with self.redis.pipeline(transaction=True) as pipe:
            # One MULTI so the head and the log are read at the same instant.
            pipe.hget(self.keys.snapshot(rollout_id), HEAD)
            pipe.xrange(self.keys.log(rollout_id))
            head, entries = await pipe.execute()
        return self._assemble(rollout_id, head, submitted_record(entries), entries)

    async def load_many(self, rollout_ids: Sequence[str]) -> list[RolloutState | Exception]:
        """``load`` of many rollouts in one round trip; each result is the state or that
        rollout's own error (not found, unreadable), so one bad rollout spoils only itself.
        One MULTI, so every head is read at the same instant as its log, as in ``load``."""
        if self.cluster:
            assert self.on_cluster is not None
            pairs = await cluster_appends.load_many(self.on_cluster, self.keys, rollout_ids)
        else:
            async with self.redis.pipeline(transaction=True) as pipe:
                for rid in rollout_ids:
                    pipe.hget(self.keys.snapshot(rid), HEAD)
                    pipe.xrange(self.keys.log(rid))
                replies = await pipe.execute(raise_on_error=False)
            pairs = list(zip(replies[::2], replies[1::2], strict=True))
        out: list[RolloutState | Exception] = []
        for rid, (head, entries) in zip(rollout_ids, pairs, strict=True):
            try:
                for reply in (head, entries):
                    if isinstance(reply, Exception):
                        raise reply
                out.append(self._assemble(rid, head, submitted_record(entries), entries))
            except Exception as exc:
                out.append(exc)
        return out

    def _assemble(
        self, rollout_id: str, head: bytes | None, sub: bytes | None, entries: list[Any]
    ) -> RolloutState:
        if head is None or sub is None:
            raise RolloutNotFound(rollout_id)
        submitted = submitted_event(rollout_id, sub)
        # The first entry is the Submitted record, decoded above. Every entry is decoded
        # anyway, so an episode's tool events come at no extra cost.
        events = decode_entries(rollout_id, entries[1:])
        chunks = tuple(e for e in events if isinstance(e, TokensAppended))
        tools = tool_events(events) if submitted.request.episode is not None else []
        state = codec.decode_snapshot(head, submitted, chunks, tools)
        if sum(len(c) for c in chunks) != state.num_tokens:
            raise CorruptRecord(
                f"snapshot counts {state.num_tokens} tokens, the log holds "
                f"{sum(len(c) for c in chunks)}",
                rollout_id=rollout_id,
                seq=state.seq,
            )
        return state

    async def head(self, rollout_id: str) -> RolloutState:
        """The current state without its token data (``chunks`` empty): what a status check
        or a ``Cancelled`` append needs, in one small read however long the rollout."""
        state = await self._head(rollout_id, None)
        assert state is not None  # only a status asked for makes it None
        return state

    async def head_at(self, rollout_id: str, status: Status) -> RolloutState | None:
        """``head`` of a rollout at ``status``, else None, judged from its snapshot's head
        before anything more is decoded or read: a runner's look at a call another runner
        claimed since costs one small round trip (bench_episodes: about half its looks)."""
        return await self._head(rollout_id, status)

    async def _head(self, rollout_id: str, status: Status | None) -> RolloutState | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            read_head(pipe, self.keys, rollout_id)
            head, first = await pipe.execute()
        sub = submitted_record(first)
        if head is None or sub is None:
            raise RolloutNotFound(rollout_id)
        if status is not None and codec.snapshot_status(head, rollout_id=rollout_id) != status:
            return None
        submitted = submitted_event(rollout_id, sub)
        if submitted.request.episode is None:
            return codec.decode_snapshot(head, submitted)  # a plain rollout: one round trip
        # An episode's calls are folded from its tool events, which lie among its token
        # records: a second read, for episodes only. Entries past the head's seq (appended
        # since it was read) are left out, so the calls are the head's.
        seq = codec.decode_snapshot(head, submitted).seq
        entries = await self.redis.xrange(self.keys.log(rollout_id), "0-2", f"0-{seq}")
        if len(entries) != seq - 1:
            raise RolloutNotFound(rollout_id)  # deleted (acknowledged, expired) in between
        # Its token records, most of its log, are left undecoded (``load`` checks them).
        rest = [e for e in entries if not codec.is_tokens_record(e[1][b"e"])]
        tools = tool_events(decode_entries(rollout_id, rest))
        return codec.decode_snapshot(head, submitted, (), tools)

    @staticmethod
    def decode_head(
        rollout_id: str, head: bytes, sub: bytes, tool_events: Sequence[ToolEvent] = ()
    ) -> RolloutState:
        """The state of a snapshot's ``head`` and the ``Submitted`` record (``read_head``),
        without token data (and without an episode's calls unless given its tool events)."""
        return codec.decode_snapshot(head, submitted_event(rollout_id, sub), (), tool_events)

    async def replay(self, rollout_id: str) -> RolloutState:
        """The state rebuilt from the log alone, checking every transition on the way."""
        state: RolloutState | None = None
        for event in await self.events(rollout_id):
            state = apply(state, event)
        if state is None:
            raise RolloutNotFound(rollout_id)
        return state

    async def fail_unreadable(self, rollout_id: str, error: str) -> bool:
        """Record ``Failed`` on a rollout whose log cannot be read but whose snapshot can.

        ``load`` refuses such a rollout, so nothing could ever run or end it and a trainer
        waiting for it would wait forever; failing it from the snapshot alone (its token data
        is not needed to end it) makes it end with the reason. True if recorded; False if it
        had ended already. Raises ``CodecError`` if the snapshot is unreadable too.
        """
        state = await self.head(rollout_id)
        if state.terminal:
            return False
        await self.append(state, commands.fail(state, error, FailureClass.UNREADABLE))
        return True

    async def events(self, rollout_id: str) -> list[Event]:
        return decode_entries(rollout_id, await self.redis.xrange(self.keys.log(rollout_id)))

    async def statuses(self, rollout_ids: Sequence[str]) -> list[Status]:
        """Each rollout's status from its snapshot head alone, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in rollout_ids:
                pipe.hget(self.keys.snapshot(rid), HEAD)
            heads = await pipe.execute()
        out = []
        for rid, head in zip(rollout_ids, heads, strict=True):
            if head is None:
                raise RolloutNotFound(rid)
            out.append(Status(codec.snapshot_status(head, rollout_id=rid)))
        return out

    async def exists(self, rollout_id: str) -> bool:
        found: int = await self.redis.hexists(self.keys.snapshot(rollout_id), HEAD)  # type: ignore[misc]
        return bool(found)
