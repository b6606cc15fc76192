"""The transition table and the pure ``apply``/``fold`` over a rollout's events."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from statemachine.episode_events import (
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolResultRecorded,
    TurnRequested,
)
from statemachine.errors import (
    AttemptMismatch,
    BudgetExceeded,
    CallMismatch,
    ClaimMismatch,
    DecisionMismatch,
    IllegalTransition,
    ModelMismatch,
    NotAnEpisode,
    OffsetMismatch,
    RoutesMismatch,
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
from statemachine.status import EPISODE_FINISH, FinishReason, Status
from statemachine.tool_calls import ToolCall, record

P, G, A, R = Status.PENDING, Status.GENERATING, Status.ABORTED, Status.RESUMED
# An episode between turns: waiting for a runner, a runner holding the call, the next turn due.
AT, RT, NT = Status.AWAITING_TOOL, Status.RUNNING_TOOL, Status.NEXT_TURN

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
    # An episode: a turn ends at a tool call (ending its attempt); a runner claims the call
    # and records its result (or a failure, or is lost: the call waits for a new claim);
    # the next turn is an attempt resuming from the saved context. A budget may end the
    # episode between turns; Failed and Cancelled end it from any state that has not ended
    # (from RUNNING_TOOL they fence the runner out: its late result is refused).
    (G, ToolCallRequested): AT,
    (R, ToolCallRequested): AT,
    (AT, ToolCallClaimed): RT,
    (AT, Finished): Status.DONE,
    (AT, Failed): Status.FAILED,
    (AT, Cancelled): Status.CANCELLED,
    (RT, ToolResultRecorded): NT,
    (RT, ToolCallFailed): AT,
    (RT, ToolCallLost): AT,
    (RT, Failed): Status.FAILED,
    (RT, Cancelled): Status.CANCELLED,
    # A harness-driven episode's next call feeds its next turn: no runner claims its calls.
    (AT, TurnRequested): NT,
    (NT, Resumed): R,
    (NT, Finished): Status.DONE,
    (NT, Failed): Status.FAILED,
    (NT, Cancelled): Status.CANCELLED,
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
    ToolCallRequested,
    ToolCallClaimed,
    ToolResultRecorded,
    ToolCallFailed,
    ToolCallLost,
    TurnRequested,
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
    if s.status is NT:
        _check_next_turn(s, e)
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
    # A harness-driven episode's max_tokens is each turn's, as its calls asked (vLLM's).
    sampled, cap = (s.turn_sampled, s.turn_sampling.max_tokens) if s.harness else (
        s.num_tokens, s.request.sampling.max_tokens)  # fmt: skip
    if sampled + n > cap:
        raise BudgetExceeded(e.rollout_id, e.seq, f"{sampled} + {n} tokens exceed max_tokens {cap}")
    episode = s.request.episode
    if episode is not None and episode.max_total_tokens is not None:
        context = s.context_tokens
        if context + n > episode.max_total_tokens:
            raise BudgetExceeded(
                e.rollout_id,
                e.seq,
                f"a context of {context} + {n} tokens exceeds max_total_tokens "
                f"{episode.max_total_tokens}",
            )
    if e.observation_routes is not None:
        _check_observation_routes(s, e)
    return s.evolve(seq=e.seq, status=after, num_tokens=s.num_tokens + n, chunks=(*s.chunks, e))


def _check_observation_routes(s: RolloutState, e: TokensAppended) -> None:
    """Observation routes ride only on the first chunk of the turn after a recorded result
    (its offset is the call's: no token of the turn before it), one row per observation
    token. So a turn records them once, however many attempts it took."""
    assert e.observation_routes is not None
    last = s.calls[-1] if s.calls else None
    if last is None or last.result is None or last.offset != e.offset:
        why = "observation routes on a chunk that does not begin a turn after a tool result"
        raise RoutesMismatch(e.rollout_id, e.seq, why)
    rows, want = e.observation_routes.shape[0], last.observation_tokens
    if rows != want:
        why = f"{rows} observation-route rows for an observation of {want} tokens"
        raise RoutesMismatch(e.rollout_id, e.seq, why)


def _aborted(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Aborted)
    _expect_attempt(s, e, e.attempt, s.attempt)
    return s.evolve(seq=e.seq, status=after, aborts=s.aborts + 1, abort_reason=e.reason)


def _finished(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, Finished)
    # Between an episode's turns no attempt is running: its Finished names attempt 0 (none),
    # so the store's fence on it is "no attempt live" and a late worker cannot race it.
    _expect_attempt(s, e, e.attempt, s.live_attempt)
    if e.finish_reason in EPISODE_FINISH and s.request.episode is None:
        raise NotAnEpisode(
            e.rollout_id, e.seq, f"finish reason {e.finish_reason} is an episode's budget"
        )
    if e.finish_reason is FinishReason.SESSION_END and not (s.harness and s.live_attempt == 0):
        raise IllegalTransition(
            e.rollout_id, e.seq, "session_end ends only a harness-driven episode between turns"
        )
    if s.live_attempt == 0 and e.finish_reason not in EPISODE_FINISH | {FinishReason.LENGTH}:
        # Between turns only a budget ends an episode: a stop is the model's, within a turn.
        raise IllegalTransition(
            e.rollout_id, e.seq, f"finish reason {e.finish_reason} between turns"
        )
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


# -- an episode's tool calls ----------------------------------------------------------------


def _requested(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, ToolCallRequested)
    _expect_episode(s, e)
    _expect_attempt(s, e, e.attempt, s.attempt)
    if e.offset != s.num_tokens:
        raise OffsetMismatch(
            e.rollout_id, e.seq, f"call at offset {e.offset} but {s.num_tokens} tokens so far"
        )
    if any(c.call_id == e.call_id for c in s.calls):
        # Claims, results and idempotency keys name a call by its id: it must be unique.
        raise CallMismatch(e.rollout_id, e.seq, f"call id {e.call_id!r} is already used")
    return s.evolve(seq=e.seq, status=after, calls=record(s.calls, e))


def _claimed(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, ToolCallClaimed)
    call = _expect_call(s, e, e.call_id)
    if s.harness:
        raise NotAnEpisode(
            e.rollout_id, e.seq, "a harness-driven episode's turns are fed by its harness's "
            "calls (TurnRequested), never claimed by a runner",
        )  # fmt: skip
    last = call.claims[-1].claim if call.claims else 0
    if e.claim != last + 1:
        raise ClaimMismatch(
            e.rollout_id, e.seq, f"claim {e.claim} of {e.call_id!r}, expected {last + 1}"
        )
    budget = s.request.episode.max_tool_seconds if s.request.episode else None
    if budget is not None and s.tool_seconds >= budget:
        # A budget is checked when a step would begin: no tool runs once tool time is used up.
        raise BudgetExceeded(
            e.rollout_id, e.seq, f"tools ran {s.tool_seconds:g} s of max_tool_seconds {budget:g}"
        )
    return s.evolve(seq=e.seq, status=after, calls=record(s.calls, e))


def _claim_ended(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, ToolResultRecorded | ToolCallFailed | ToolCallLost)
    call = _expect_call(s, e, e.call_id)
    if e.claim != call.live_claim:
        # A zombie runner (its claim was declared lost, the call claimed again) reports late.
        raise ClaimMismatch(
            e.rollout_id,
            e.seq,
            f"{type(e).__name__} names claim {e.claim} of {e.call_id!r}; "
            f"the live claim is {call.live_claim}",
        )
    if isinstance(e, ToolCallLost):
        assert s.request.episode is not None  # a call exists only in an episode
        declared = s.request.episode.effect_of(call.name)
        if e.decision is not declared:
            raise DecisionMismatch(
                e.rollout_id,
                e.seq,
                f"lost call of {call.name!r} decided {e.decision}; the tool declares {declared}",
            )
    return s.evolve(seq=e.seq, status=after, calls=record(s.calls, e))


def _turn_requested(s: RolloutState | None, e: Event, after: Status) -> RolloutState:
    assert s is not None and isinstance(e, TurnRequested)
    _expect_call(s, e, e.call_id)
    if not s.harness:
        raise NotAnEpisode(
            e.rollout_id, e.seq, "TurnRequested feeds only a harness-driven episode; an "
            "environment's calls are claimed and their results recorded",
        )  # fmt: skip
    if e.sampling.logprobs != s.request.sampling.logprobs:
        # Every token of an episode carries the same top-k (its arrays stay rectangular): a
        # call asking another k is not this episode's next turn.
        raise TopLogprobsMismatch(
            e.rollout_id, e.seq, f"the turn asks logprobs={e.sampling.logprobs}; the episode "
            f"records {s.request.sampling.logprobs}",
        )  # fmt: skip
    return s.evolve(seq=e.seq, status=after, calls=record(s.calls, e))


def _check_next_turn(s: RolloutState, e: Event) -> None:
    """An episode's next turn begins only within its turn and context budgets."""
    episode = s.request.episode
    assert episode is not None
    if episode.max_turns is not None and len(s.calls) >= episode.max_turns:
        raise BudgetExceeded(
            e.rollout_id, e.seq, f"turn {len(s.calls) + 1} exceeds max_turns {episode.max_turns}"
        )
    if episode.max_total_tokens is not None and s.context_tokens >= episode.max_total_tokens:
        raise BudgetExceeded(
            e.rollout_id,
            e.seq,
            f"a context of {s.context_tokens} tokens leaves no room under max_total_tokens "
            f"{episode.max_total_tokens}",
        )


def _expect_episode(s: RolloutState, e: Event) -> None:
    if s.request.episode is None:
        raise NotAnEpisode(e.rollout_id, e.seq, f"{type(e).__name__} on a plain rollout")


def _expect_call(s: RolloutState, e: Event, call_id: str) -> ToolCall:
    call = s.pending_call
    # The tool states are reached only through a request: a call is pending in them.
    assert call is not None
    if call_id != call.call_id:
        raise CallMismatch(
            e.rollout_id, e.seq, f"call {call_id!r} is not the pending call {call.call_id!r}"
        )
    return call


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
    ToolCallRequested: _requested,
    ToolCallClaimed: _claimed,
    ToolResultRecorded: _claim_ended,
    ToolCallFailed: _claim_ended,
    ToolCallLost: _claim_ended,
    TurnRequested: _turn_requested,
}
