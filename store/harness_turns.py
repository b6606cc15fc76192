"""A harness's session as durable episodes: each call of a session is one turn.

A harness that runs its own tools (chat with ``tools``, or any calls under one
``X-Session-ID``) sends, call after call, the whole conversation so far. Recorded as a rollout
per call, a session of ``T`` turns over a context of ``C`` tokens would store ~``T * C / 2``
prompt tokens. Here the session's calls are the turns of one harness-driven episode
(``EpisodeSpec.harness``), one rollout:

- a call whose prompt extends the episode's context (prompt, sampled and fed tokens, in the
  order fed: the usual case) is its next turn: ``TurnRequested`` records only the tokens its
  prompt adds (tool results, template tokens) and its own sampling, in the transaction that
  pushes the turn's job (``store.turn_jobs``);
- any other call (the first, one that rewrote history or asks another top-k) starts a new
  episode, submitted as a batch under the call's id as any call is; the episode it leaves, if
  it waits for a next call, ends (``session_end``).

A call's answer is its turn: the prompt it sent, the tokens sampled in the turn and how the
turn ended (``turn_result``). The worker ends a turn wherever its generation ends and records
that end; the append adds an entry to the call's completion stream, which the call waits on
(``lua/tool_call_index.lua``). A call's id (its batch id, from its key: ``store.api.harness``)
finds its turn again for a retry: the episode's own batch record for its first call, the
session's turn index (``Keys.session_turns``: call -> episode, turn, fingerprint) for the
others. Those two writes and the append are separate steps (a session's keys and an episode's
live in different Cluster slots); each is repeatable, and a retry completes what a crash left.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, replace

import msgpack
import numpy as np

from statemachine import (
    TERMINAL,
    EpisodeSpec,
    RolloutRequest,
    RolloutState,
    Status,
    TurnRequested,
    apply,
    harness_commands,
)
from store import sessions
from store.affinity import Affinity
from store.batches import BatchConflict
from store.client import RolloutClient
from store.completions import follow
from store.errors import RolloutNotFound, SequenceConflict
from store.turn_jobs import TurnJobs
from store.turn_results import HARNESS_METADATA

APPEND_TRIES = 5  # a turn's append refused by a racing event: looked at again this often
# How many of a session's latest calls are looked at for its episode (calls noted and never
# recorded are passed over: one crashed submit each).
LOOK_BACK = 4


@dataclass(frozen=True, slots=True)
class Turn:
    """A call's turn: the episode, which turn (0-based), and the call's batch id."""

    rollout_id: str
    turn: int
    batch_id: str
    fresh: bool = False  # recorded by this call: it has not ended yet


def fingerprint(request: RolloutRequest) -> str:
    """What a retry of a call must repeat: its prompt and sampling (a key's other body is a
    409, as for any call)."""
    packed = msgpack.packb([list(request.prompt_token_ids), request.sampling.to_dict()])
    return hashlib.sha256(packed).hexdigest()[:32]


class HarnessTurns:
    """The turns of harness sessions, on ``client``'s Redis."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.store = client.store
        self.keys = client.keys
        self.jobs = TurnJobs(client.sync_redis, client.keys, apart=client.queue_apart)

    async def begin(self, session: str, batch_id: str, request: RolloutRequest) -> Turn:
        """The call ``batch_id`` of ``session``: its turn, recorded if it was not (``request``:
        the call's prompt and sampling). ``Turn.fresh`` when this call recorded it. Raises
        ``BatchConflict`` for a key already used by another call."""
        turns, recorded, listed = await self._look(session, batch_id)
        entry = turns.get(batch_id)
        if entry is not None:  # a retry of a later turn's call
            found = await self._recorded(session, batch_id, request, entry)
            if found is not None:
                return found
        elif recorded:  # a retry of an episode's first call: the submit checks its body
            return await self._start(session, batch_id, request, fresh=False)
        last = await self._last_episode([b for b in listed if b != batch_id], turns)
        if last is not None and _continues(last, request):
            turn = await self._continue(session, batch_id, request, last)
            if turn is not None:
                return turn
        if last is not None:
            await self.end(last)  # the session moved on from it
        return await self._start(session, batch_id, request, fresh=True)

    async def end(self, state: RolloutState) -> None:
        """End the episode if it waits for a next call (``session_end``); else nothing."""
        events = harness_commands.end_session(state)
        if events:
            # A call fed it meanwhile: it goes on, and ends later (idle, or finished).
            with contextlib.suppress(SequenceConflict):
                await self.store.append_chain(state, events)

    async def finish(self, session: str) -> None:
        """The harness finished the session (SkyRL's ``/finish_session``): its episode ends
        (if its last turn has; else it ends idle, ``SESSION_IDLE_S`` after that turn)."""
        turns, _, listed = await self._look(session, "")
        last = await self._last_episode(listed, turns)
        if last is not None:
            await self.end(last)

    async def wait(self, turn: Turn, timeout: float | None) -> RolloutState:
        """The episode once ``turn`` ended (its call's answer is ready) or the episode did."""
        if turn.fresh or not _ended(await self.store.head(turn.rollout_id), turn.turn):
            # Recorded by this call, the turn has not ended: no look before the stream's.
            async for _ in follow(self.client.redis, self.keys, turn.batch_id,
                                  [turn.rollout_id], timeout=timeout, turns=True,
                                  gone=self._gone):  # fmt: skip
                pass
        return await self.store.load(turn.rollout_id)

    async def _gone(self, ids: list[str]) -> list[str]:
        return [r for r in ids if not await self.client.redis.exists(self.keys.snapshot(r))]

    async def _look(self, session: str, batch_id: str) -> tuple[dict[str, str], bool, list[str]]:
        """One round trip: the session's turn index, whether ``batch_id`` has a batch record
        (an episode's first call), and the session's calls in order."""
        async with self.client.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.session_turns(session))
            pipe.exists(self.keys.batch(batch_id))
            pipe.zrange(self.keys.session(session), 0, -1)
            turns, recorded, listed = await pipe.execute()
        entries = {k.decode(): v.decode() for k, v in turns.items()}
        return entries, bool(recorded), [b.decode() for b in listed]

    async def _recorded(
        self, session: str, batch_id: str, request: RolloutRequest, entry: str
    ) -> Turn | None:
        """A later turn's call found in the turn index: its turn, completed where a crash cut
        its recording short; None (its entry removed) if the episode moved on without it."""
        rid, turn, fp = entry.split(" ")
        if fp != fingerprint(request):
            raise BatchConflict(f"call {batch_id!r} was made with another body")
        fed = await self._fed(Turn(rid, int(turn), batch_id), request, None, session)
        if fed is None:
            await self.client.redis.hdel(self.keys.session_turns(session), batch_id)  # type: ignore[misc]
        return fed

    async def _last_episode(self, listed: list[str], turns: dict[str, str]) -> RolloutState | None:
        """The episode of the session's latest recorded call, if that call is a harness turn.
        (A call noted and never recorded is passed over; a first call's rollout is its batch's
        ``<batch>.0.0``: a harness call names no ids.)"""
        for batch_id in reversed(listed[-LOOK_BACK:]):
            entry = turns.get(batch_id)
            rid = entry.split(" ")[0] if entry is not None else f"{batch_id}.0.0"
            try:
                # Whole: the call's prompt is checked against the context's tokens.
                state = await self.store.load(rid)
            except RolloutNotFound:
                continue
            return state if state.harness else None
        return None

    async def _continue(
        self, session: str, batch_id: str, request: RolloutRequest, last: RolloutState
    ) -> Turn | None:
        """Record the call as ``last``'s next turn; None if the episode moved on meanwhile (a
        racing call took the turn): the call then starts an episode of its own."""
        turn = Turn(last.rollout_id, len(last.calls), batch_id, fresh=True)
        entry = f"{turn.rollout_id} {turn.turn} {fingerprint(request)}"
        worker = await sessions.note_turn(self.client.redis, self.keys, session, batch_id,
                                          entry, time.time(), self.client.retention_s)  # fmt: skip
        fed = await self._fed(turn, request, last, session, worker)
        if fed is None:
            await self.client.redis.hdel(self.keys.session_turns(session), batch_id)  # type: ignore[misc]
        return fed

    async def _fed(
        self,
        turn: Turn,
        request: RolloutRequest,
        state: RolloutState | None,
        session: str,
        worker: str | None = None,
    ) -> Turn | None:
        """``turn`` once its ``TurnRequested`` is in the log (appended here if it is not and
        the episode still waits for exactly that turn); None if another call took it. The
        turn's job prefers ``worker`` (the session's: ``store.affinity``)."""
        fields = Affinity(session, worker).job_fields()
        for _ in range(APPEND_TRIES):
            if state is None:
                try:
                    state = await self.store.load(turn.rollout_id)
                except RolloutNotFound:
                    return None
            if _fed_by(state, turn):
                return turn
            if len(state.calls) != turn.turn or not _continues(state, request):
                return None
            event = _request_turn(state, turn.batch_id, request)
            then = await self.jobs.step(apply(state, event), fields)
            try:
                await self.store.append_chain(state, [event], then=then)
            except BaseException as exc:
                self.jobs.forget(turn.rollout_id)  # the queue apart: no job to push
                if isinstance(exc, SequenceConflict):
                    state = None  # something landed since the read: look again
                    continue
                raise
            # The queue apart (store.queue_redis): the turn's job, once its call landed.
            await self.jobs.push(self.store.redis, turn.rollout_id)
            return turn
        return None

    async def _start(
        self, session: str, batch_id: str, request: RolloutRequest, *, fresh: bool
    ) -> Turn:
        batch = await self.client.submit(
            [_episode_request(request, session)], batch_id=batch_id, session=session
        )
        return Turn(batch[0], 0, batch_id, fresh=fresh and batch.fresh)


def _episode_request(request: RolloutRequest, session: str) -> RolloutRequest:
    """The call's request as a harness-driven episode's first turn."""
    meta = {**request.metadata, "session": session, HARNESS_METADATA: True}
    return replace(request, episode=EpisodeSpec(harness=True), metadata=meta)


def _continues(state: RolloutState, request: RolloutRequest) -> bool:
    """Whether the call is the episode's next turn: it waits for one, and the call's prompt
    extends its context and asks the same top-k (its tokens keep one)."""
    if not state.harness or state.status is not Status.AWAITING_TOOL:
        return False
    if request.sampling.logprobs != state.request.sampling.logprobs:
        return False
    context = state.resume_prompt()
    prompt = request.prompt_token_ids
    return len(prompt) >= len(context) and prompt[: len(context)] == context


def _request_turn(state: RolloutState, batch_id: str, request: RolloutRequest) -> TurnRequested:
    added = request.prompt_token_ids[len(state.resume_prompt()) :]
    return harness_commands.request_turn(
        state, call_batch=batch_id, observation_token_ids=np.asarray(added, dtype=np.int32),
        sampling=request.sampling,
    )  # fmt: skip


def _fed_by(state: RolloutState, turn: Turn) -> bool:
    """Whether ``turn`` of the episode was fed by the call ``turn.batch_id``."""
    if turn.turn == 0:
        return True
    if len(state.calls) < turn.turn:
        return False
    fed = state.calls[turn.turn - 1].result
    return isinstance(fed, TurnRequested) and fed.call_batch == turn.batch_id


def _ended(state: RolloutState, turn: int) -> bool:
    return state.status in TERMINAL or len(state.calls) > turn
