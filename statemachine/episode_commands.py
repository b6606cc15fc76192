"""Commands of an episode's tool calls: what happened, turned into the events that record it.

As in ``commands``, callers say what happened and these functions number the events. A runner
passes the call and the claim it holds (never read back from the state: they are its fence, so
a zombie runner's late report names its old claim and is refused). Each command checks its
chain with ``transitions.apply`` and, where a budget decides, ends the episode after it.

Budgets are checked when a step would begin, never by refusing a fact: a result whose run time
or observation uses up a budget is recorded (its side effect happened) and the episode ends
after it; no tool is claimed once tool time is used up, no turn begins beyond ``max_turns`` or
with no room left under ``max_total_tokens``.
"""

from __future__ import annotations

from typing import Any

from statemachine.commands import NewTokens, checkpoint
from statemachine.episode import ToolEffect
from statemachine.episode_events import (
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolResultRecorded,
)
from statemachine.errors import CallMismatch, IllegalTransition
from statemachine.events import Event, Failed, Finished
from statemachine.rollout_state import RolloutState
from statemachine.status import FailureClass, FinishReason, Status, ToolFailure
from statemachine.transitions import apply


def budget_reached(state: RolloutState, now: float | None = None) -> FinishReason | None:
    """The budget that leaves an episode between turns no next step, if any (the first in
    this order: turns, tool time, context, sampled tokens, wall time). ``now`` is the caller's
    clock, compared with the submission's: wall time is a caller's decision, the domain
    never reads a clock (and clocks of two machines disagree by what they disagree by)."""
    episode = state.request.episode
    if episode is None or state.status not in (Status.AWAITING_TOOL, Status.NEXT_TURN):
        return None
    if episode.max_turns is not None and len(state.calls) >= episode.max_turns:
        return FinishReason.MAX_TURNS  # its result could only feed a turn beyond the budget
    if (
        state.status is Status.AWAITING_TOOL
        and episode.max_tool_seconds is not None
        and state.tool_seconds >= episode.max_tool_seconds
    ):
        return FinishReason.TOOL_TIME  # a tool is next, and no tool time is left
    if episode.max_total_tokens is not None and state.context_tokens >= episode.max_total_tokens:
        return FinishReason.MAX_TOTAL_TOKENS
    if not state.harness and state.num_tokens >= state.request.sampling.max_tokens:
        # (A harness-driven episode's max_tokens is each turn's: its next call brings more.)
        return FinishReason.LENGTH
    if (
        now is not None
        and episode.max_wall_seconds is not None
        and now - state.submitted_at >= episode.max_wall_seconds
    ):
        return FinishReason.WALL_TIME
    return None


def end_on_budget(state: RolloutState, now: float | None = None) -> list[Event]:
    """``Finished`` with the budget's reason when a budget leaves the episode no next step,
    else nothing. Written between turns, so it names attempt 0 (no attempt is running)."""
    reason = budget_reached(state, now)
    if reason is None:
        return []
    return [Finished(rollout_id=state.rollout_id, seq=state.seq + 1, attempt=0,
                     finish_reason=reason)]  # fmt: skip


def request_call(
    state: RolloutState,
    *,
    name: str,
    arguments: str,
    call_id: str | None = None,
    idempotency_key: str | None = None,
    tokens: NewTokens | None = None,
    now: float | None = None,
) -> list[Event]:
    """The live attempt's turn ended at a call of tool ``name``: its last tokens (if any),
    then ``ToolCallRequested``, before any side effect. ``call_id`` defaults to the call's
    number in the episode; ``idempotency_key`` to one that names the rollout and the call,
    the same for every claim of it. A budget that leaves the call no use ends the episode
    right after the request (the call stays in the record; no tool runs)."""
    events: list[Event] = []
    if tokens is not None and len(tokens):
        events.append(checkpoint(state, tokens))
        state = apply(state, events[-1])
    call_id = call_id or f"call-{len(state.calls) + 1}"
    events.append(
        ToolCallRequested(
            rollout_id=state.rollout_id,
            seq=state.seq + 1,
            attempt=state.attempt,
            offset=state.num_tokens,
            call_id=call_id,
            name=name,
            arguments=arguments,
            idempotency_key=idempotency_key or f"{state.rollout_id}/{call_id}",
        )
    )
    return events + end_on_budget(apply(state, events[-1]), now)


def claim_call(state: RolloutState, runner_id: str) -> ToolCallClaimed:
    """Runner ``runner_id`` takes the pending call under the next claim number."""
    call = state.pending_call
    if call is None:
        raise IllegalTransition(state.rollout_id, state.seq + 1, "no tool call is pending")
    last = call.claims[-1].claim if call.claims else 0
    return ToolCallClaimed(rollout_id=state.rollout_id, seq=state.seq + 1, call_id=call.call_id,
                           runner_id=runner_id, claim=last + 1)  # fmt: skip


def record_result(
    state: RolloutState,
    *,
    call_id: str,
    claim: int,
    observation_token_ids: Any,
    seconds: float,
    env_handle: str = "",
    env_revision: str = "",
    now: float | None = None,
) -> list[Event]:
    """The result of claim ``claim`` of ``call_id``, then ``Finished`` if it leaves the next
    turn no room (the context full, the sampled budget spent, or the wall time passed)."""
    result = ToolResultRecorded(
        rollout_id=state.rollout_id,
        seq=state.seq + 1,
        call_id=call_id,
        claim=claim,
        observation_token_ids=observation_token_ids,
        env_handle=env_handle,
        env_revision=env_revision,
        seconds=seconds,
    )
    return [result, *end_on_budget(apply(state, result), now)]


def fail_call(
    state: RolloutState,
    *,
    call_id: str,
    claim: int,
    failure: ToolFailure,
    error: str,
    retries: int,
    seconds: float = 0.0,
    now: float | None = None,
) -> list[Event]:
    """Claim ``claim`` of ``call_id`` failed. ``env_fatal`` ends the episode (``Failed``);
    ``env_error`` leaves the call for a new claim while the call has failed so at most
    ``retries`` times, and ends the episode on the failure after that."""
    failed = ToolCallFailed(rollout_id=state.rollout_id, seq=state.seq + 1, call_id=call_id,
                            claim=claim, failure=failure, error=error, seconds=seconds)  # fmt: skip
    after = apply(state, failed)
    if failed.failure is ToolFailure.ENV_FATAL:
        return [failed, _failed(after, FailureClass.ENV_FATAL, f"{call_id}: {error}")]
    call = after.calls[-1]
    errors = sum(c.failure is ToolFailure.ENV_ERROR for c in call.claims)
    if errors > retries:
        why = f"{call_id} failed {errors} times (retries {retries}): {error}"
        return [failed, _failed(after, FailureClass.ENV_ERROR, why)]
    return [failed, *end_on_budget(after, now)]


def lose_call(
    state: RolloutState,
    *,
    call_id: str,
    claim: int,
    detail: str = "",
    now: float | None = None,
) -> list[Event]:
    """Claim ``claim`` of ``call_id`` lost its runner with no result: the call's effect is
    unverified and its tool's declared effect decides. ``idempotent`` and ``restore`` leave
    the call for a new claim (the runner of a ``restore`` restores the revision of the last
    result first); ``restart`` ends the episode (``Failed(effect_unverified)``)."""
    call = state.pending_call
    if call is None or call.call_id != call_id:
        raise CallMismatch(state.rollout_id, state.seq + 1, f"{call_id!r} is not pending")
    assert state.request.episode is not None  # a call is pending only in an episode
    decision = state.request.episode.effect_of(call.name)
    lost = ToolCallLost(rollout_id=state.rollout_id, seq=state.seq + 1, call_id=call_id,
                        claim=claim, decision=decision, detail=detail)  # fmt: skip
    after = apply(state, lost)
    if decision is ToolEffect.RESTART:
        why = f"{call_id} ({call.name}): runner lost, effect unverified; the tool declares restart"
        return [lost, _failed(after, FailureClass.EFFECT_UNVERIFIED, why)]
    return [lost, *end_on_budget(after, now)]


def restore_revision(state: RolloutState) -> str | None:
    """The environment revision a ``restore`` goes back to: the one recorded with the
    episode's last result (None before any: the environment's initial state)."""
    for call in reversed(state.calls):
        if call.result is not None:
            return call.result.env_revision
    return None


def _failed(state: RolloutState, failure: FailureClass, error: str) -> Failed:
    return Failed(rollout_id=state.rollout_id, seq=state.seq + 1, error=error,
                  attempts=state.attempt, failure=failure)  # fmt: skip
