"""Chains of events on one rollout (a takeover's Aborted + Resumed, a budget's Aborted +
Failed, a checkpoint + Finished) against writers whose views lag: the log stays legal.

Issue 28 found a takeover from a view one checkpoint old that wrote ``Resumed`` after its
``Aborted`` had been refused: the log became illegal (``replay`` raised), the snapshot
disagreed with the log (``load`` raised) and the live worker was fenced out. The store now
refuses the rest of a chain once one of its events is refused, and opens an attempt only while
none is live. Run on fakeredis and on a real redis-server (``store`` fixture).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine import (
    LIVE,
    AbortReason,
    FailureClass,
    RolloutState,
    Status,
    commands,
)
from statemachine.errors import TransitionError
from store import EventStore, SequenceConflict, StaleAttempt
from tests import factories as f


def begin(state: RolloutState, worker: str) -> list[Any]:
    return commands.begin(state, worker_id=worker, weight_version=0, weight_mode="abort", model="")


async def assert_legal(store: EventStore, rid: str) -> RolloutState:
    """The log replays through the transition table, its fold equals the snapshot, and its
    token offsets are contiguous from 0."""
    replayed = await store.replay(rid)
    loaded = await store.load(rid)
    assert loaded == replayed
    offset = 0
    for chunk in loaded.chunks:
        assert chunk.offset == offset
        offset += len(chunk)
    assert offset == loaded.num_tokens
    return loaded


async def live_on_x(store: EventStore, rid: str = "r1") -> RolloutState:
    s = await store.append(None, f.submitted(rid, max_tokens=64))
    return await store.append(s, f.started(s, worker="X"))


async def test_takeover_from_a_view_one_checkpoint_old_writes_nothing(store: EventStore) -> None:
    """The issue's reproduction, step by step."""
    s1 = await live_on_x(store)
    stale = s1
    s2 = await store.append(s1, f.tokens(s1, n=16))  # X saves 16 tokens
    # Z takes over from the view before that checkpoint: [Aborted #3, Resumed #4].
    [result] = await store.append_many([(stale, begin(stale, "Z"))])
    assert isinstance(result, SequenceConflict)
    events = await store.events("r1")
    assert [type(e).__name__ for e in events] == ["Submitted", "Started", "TokensAppended"]
    loaded = await assert_legal(store, "r1")
    assert loaded == s2 and loaded.status is Status.GENERATING and loaded.worker_id == "X"
    # X is still the live attempt: its next checkpoint is accepted.
    s3 = await store.append(s2, f.tokens(s2, n=4))
    assert (await assert_legal(store, "r1")).num_tokens == 20 == s3.num_tokens


async def test_budget_failure_from_a_stale_view_writes_nothing(store: EventStore) -> None:
    """The same defect's sibling: ``[Aborted, Failed]`` (a takeover that spends the rollout's
    worker-lost budget, workers/failures.py). ``Failed`` carries no fence, so after the
    refused ``Aborted`` it would land on the live rollout with a snapshot counting the stale
    view's tokens."""
    s1 = await live_on_x(store)
    stale = s1
    s2 = await store.append(s1, f.tokens(s1, n=16))
    [abort] = commands.abort(stale, AbortReason.WORKER_LOST, "taken over by Z")
    chain = [abort, commands.fail(_aborted(stale, abort), "budget", FailureClass.WORKER_LOST)]
    [result] = await store.append_many([(stale, chain)])
    assert isinstance(result, SequenceConflict)
    assert await assert_legal(store, "r1") == s2


def _aborted(state: RolloutState, abort: Any) -> RolloutState:
    from statemachine import apply

    return apply(state, abort)


async def test_an_attempt_opens_only_while_none_is_live(store: EventStore) -> None:
    """A ``Resumed`` whose seq is free but whose rollout has a live attempt is refused as
    stale, whoever computed it: here the view that says "aborted" is a refused chain's."""
    s1 = await live_on_x(store)
    s2 = await store.append(s1, f.tokens(s1, n=2))
    # A view in which X's attempt was aborted at seq 3 (refused: X's checkpoint holds it) and
    # a Resumed computed from it for seq 4, sent alone.
    ghost = _aborted(s1, f.aborted(s1))
    with pytest.raises(StaleAttempt) as refused:
        await store.append(ghost, f.resumed(ghost, worker="Z"))
    assert refused.value.live == 1
    assert await assert_legal(store, "r1") == s2


async def test_a_retried_chain_is_recognised_whole(store: EventStore) -> None:
    """A takeover whose reply was lost and is sent again: both events are recognised as the
    writer's own (dup), the state after them is returned, nothing is written twice."""
    s1 = await live_on_x(store)
    chain = begin(s1, "Z")
    [first] = await store.append_many([(s1, chain)])
    [again] = await store.append_many([(s1, chain)])
    assert isinstance(first, RolloutState) and again == first
    assert first.status is Status.RESUMED and first.worker_id == "Z"
    assert len(await store.events("r1")) == 4
    await assert_legal(store, "r1")


async def test_a_checkpoint_and_finish_chain_after_a_takeover_is_refused(
    store: EventStore,
) -> None:
    """X, taken over by Z, sends its last tokens and Finished: both refused (stale)."""
    s1 = await live_on_x(store)
    [z] = await store.append_many([(s1, begin(s1, "Z"))])
    assert isinstance(z, RolloutState)
    tokens = f.tokens(s1, n=3)
    [result] = await store.append_many([(s1, [tokens, f.finished(_aborted(s1, tokens))])])
    assert isinstance(result, StaleAttempt)
    assert await assert_legal(store, "r1") == z


# -- random interleavings of two writers ----------------------------------------------------

ACTIONS = ("checkpoint", "finish", "takeover", "abort", "fail", "cancel", "reload")


@dataclass
class Writer:
    name: str
    view: RolloutState

    def chain(self, action: str, n: int) -> list[Any] | None:
        """The events this writer would send for ``action`` from its view (None: the action
        makes no sense from it, as a real worker would not send it)."""
        s = self.view
        ours = s.status in LIVE and s.worker_id == self.name
        if action == "checkpoint" and ours:
            return [f.tokens(s, n=n)]
        if action == "finish" and ours:
            tokens = f.tokens(s, n=n)
            return [tokens, f.finished(_aborted(s, tokens))]
        if action == "takeover" and not s.terminal:
            return begin(s, self.name)
        if action == "abort" and ours:
            return [f.aborted(s, AbortReason.WEIGHT_UPDATE)]
        if action == "fail" and not s.terminal:
            live = s.status in LIVE
            before = commands.abort(s, AbortReason.WORKER_LOST, "budget") if live else []
            after = _aborted(s, before[0]) if before else s
            return [*before, commands.fail(after, "budget", FailureClass.WORKER_LOST)]
        if action == "cancel" and not s.terminal:
            return [f.cancelled(s)]
        return None


STEP = st.tuples(st.sampled_from((0, 1)), st.sampled_from(ACTIONS), st.integers(1, 5),
                 st.booleans())  # fmt: skip
PROGRAMS = st.lists(STEP, min_size=4, max_size=16)


def draw_programs(n: int) -> list[list[tuple[int, str, int, bool]]]:
    out: list[list[tuple[int, str, int, bool]]] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(PROGRAMS)
    def collect(program: list[tuple[int, str, int, bool]]) -> None:
        out.append(program)

    collect()
    return out


Program = list[tuple[int, str, int, bool]]


async def run_program(store: EventStore, rid: str, program: Program) -> int:
    """Two writers, X (the first attempt's worker) and Z, each acting on its own view, which
    moves on only with its own accepted appends or an explicit reload: stale views are the
    point. A step flagged ``together`` sends both writers' chains at once. After every step
    the log is legal and its fold is the snapshot. Returns the refusals seen."""
    s = await live_on_x(store, rid)
    writers = [Writer("X", s), Writer("Z", s)]
    refused = 0

    async def act(w: Writer, action: str, n: int) -> None:
        nonlocal refused
        if action == "reload":
            w.view = await store.load(rid)
            return
        chain = w.chain(action, n)
        if chain is None:
            return
        [result] = await store.append_many([(w.view, chain)])
        if isinstance(result, RolloutState):
            w.view = result
        elif isinstance(result, TransitionError):
            raise result  # the writers only send what their views allow
        else:
            refused += 1

    for who, action, n, together in program:
        if together:
            other = random.Random(n).choice(ACTIONS)
            await asyncio.gather(act(writers[who], action, n), act(writers[1 - who], other, n))
        else:
            await act(writers[who], action, n)
        await assert_legal(store, rid)
    return refused


async def test_random_interleavings_of_two_writers_keep_every_log_legal(
    store: EventStore,
) -> None:
    programs = draw_programs(80)
    refused = 0
    for i, program in enumerate(programs):
        try:
            refused += await run_program(store, f"p{i}", program)
        except AssertionError as exc:
            raise AssertionError(f"program {i}: {program}") from exc
    # The runs did exercise refusals (stale views), not only the happy path.
    assert refused > 20
