"""The transition table and the pure ``apply``/``fold`` over a rollout's events."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from statemachine.errors import (
    AttemptMismatch,
    BudgetExceeded,
    IllegalTransition,
    ModelMismatch,
    OffsetMismatch,
    SequenceGap,
    TopLogprobsMismatch,
)
from statemachine.events import (
    Aborted,
    Cancelled,
    Event,
    Failed,
    Finished,
    Resumed,
    Started,
    Submitted,
    TokensAppended,
)
from statemachine.rollout_state import RolloutState
from statemachine.status import Status

P, G, A, R = Status.PENDING, Status.GENERATING, Status.ABORTED, Status.RESUMED

# (state before, event type) -> state after. ``None`` is "no rollout yet". Anything absent is
# illegal; terminal states have no outgoing edges at all.
TRANSITIONS: dict[tuple[Status | None, type[Event]], Status] = {
    (None, Submitted): P,
    (P, Started): G,
    (P, Cancelled): Status.CANCELLED,
    (P, Failed): Status.FAILED,
    (G, TokensAppended): G,
    (G, Aborted): A,
    (G, Finished): Status.DONE,
    (G, Failed): Status.FAILED,
    (G, Cancelled): Status.CANCELLED,
    (A, Resumed): R,
    (A, Failed): Status.FAILED,
    (A, Cancelled): Status.CANCELLED,
    (R, TokensAppended): R,
    (R, Aborted): A,
    (R, Finished): Status.DONE,
    (R, Failed): Status.FAILED,
    (R, Cancelled): Status.CANCELLED,
}

EVENT_TYPES: tuple[type[Event], ...] = (
    Submitted,
    Started,
    TokensAppended,
    Aborted,
    Resumed,
    Finished,
    Failed,
    Cancelled,
)


def apply(state: RolloutState | None, event: Event) -> RolloutState:
    """The state after ``event``. Raises a ``TransitionError`` and changes nothing if illegal."""
    before = state.status if state is not None else None
    if state is not None and event.rollout_id != state.rollout_id:
        raise IllegalTransition(
            event.rollout_id,
            event.seq,
            f"event belongs to {event.rollout_id!r}, state to {state.rollout_id!r}",
        )
    expected_seq = state.seq + 1 if state is not None else 1
    if event.seq != expected_seq:
        raise SequenceGap(event.rollout_id, event.seq, f"expected sequence number {expected_seq}")
    after = TRANSITIONS.get((before, type(event)))
    if after is None:
        raise IllegalTransition(
            event.rollout_id,
            event.seq,
            f"{type(event).__name__} is not allowed in state {before or 'new'}",
        )
    return _MUTATORS[type(event)](state, event, after)


def fold(events: Iterable[Event], state: RolloutState | None = None) -> RolloutState | None:
    for event in events:
        state = apply(state, event)
    return state


# -- one mutator per event type: check the event against the state, return the new state ----


def _submitted(_: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert isinstance(e, Submitted)
    return RolloutState(
        rollout_id=e.rollout_id,
        seq=e.seq,
        status=after,
        request=e.request,
        submitted_at=e.at,
        admitted_version=e.admitted_version,
        queue=e.queue,
        membership=e.membership,
    )


def _begun(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Started | Resumed)
    _expect_attempt(s, e, e.attempt, s.attempt + 1)
    if s.model and e.model and e.model != s.model:
        raise ModelMismatch(
            e.rollout_id,
            e.seq,
            f"attempt {e.attempt} would run model {e.model!r}; earlier attempts ran {s.model!r}",
        )
    return s.evolve(
        seq=e.seq,
        status=after,
        attempt=e.attempt,
        worker_id=e.worker_id,
        weight_version=e.weight_version,
        model=s.model or e.model,
        abort_reason=None,
    )


def _tokens(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, TokensAppended)
    _expect_attempt(s, e, e.attempt, s.attempt)
    if e.offset != s.num_tokens:
        raise OffsetMismatch(
            e.rollout_id, e.seq, f"offset {e.offset} but {s.num_tokens} tokens so far"
        )
    if e.top_k != s.request.sampling.logprobs:
        # Every token of a rollout carries the top-k its request asked for, or none: a result
        # never has some tokens without them (or ragged widths).
        raise TopLogprobsMismatch(
            e.rollout_id,
            e.seq,
            f"chunk carries top-{e.top_k} logprobs; the request asked for "
            f"logprobs={s.request.sampling.logprobs}",
        )
    n = len(e)
    if s.num_tokens + n > s.request.sampling.max_tokens:
        raise BudgetExceeded(
            e.rollout_id,
            e.seq,
            f"{s.num_tokens} + {n} tokens exceed max_tokens {s.request.sampling.max_tokens}",
        )
    return s.evolve(seq=e.seq, status=after, num_tokens=s.num_tokens + n, chunks=(*s.chunks, e))


def _aborted(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Aborted)
    _expect_attempt(s, e, e.attempt, s.attempt)
    return s.evolve(seq=e.seq, status=after, aborts=s.aborts + 1, abort_reason=e.reason)


def _finished(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Finished)
    _expect_attempt(s, e, e.attempt, s.attempt)
    return s.evolve(
        seq=e.seq, status=after, finish_reason=e.finish_reason, stop_reason=e.stop_reason
    )


def _failed(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Failed)
    _expect_attempt(s, e, e.attempts, s.attempt)
    return s.evolve(seq=e.seq, status=after, error=e.error, failure=e.failure)


def _cancelled(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Cancelled)
    return s.evolve(seq=e.seq, status=after, error=e.reason or None)


def _expect_attempt(s: RolloutState, e: Event, got: int, want: int) -> None:
    if got != want:
        raise AttemptMismatch(
            e.rollout_id, e.seq, f"{type(e).__name__} names attempt {got}, expected {want}"
        )


_Mutator = Callable[[RolloutState | None, Event, Status], RolloutState]
_MUTATORS: dict[type[Event], _Mutator] = {
    Submitted: _submitted,
    Started: _begun,
    Resumed: _begun,
    TokensAppended: _tokens,
    Aborted: _aborted,
    Finished: _finished,
    Failed: _failed,
    Cancelled: _cancelled,
}
