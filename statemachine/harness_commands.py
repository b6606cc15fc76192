"""Commands of a harness-driven episode (``EpisodeSpec.harness``): each call of a harness's
session is one turn. The worker ends a turn wherever its generation ends (``end_turn``); the
harness's next call, whose prompt extends the episode's context, feeds the next turn
(``request_turn``); the session's end ends the episode (``end_session``).

A turn's end is recorded as ``ToolCallRequested`` named ``HARNESS_CALL`` whose arguments are
the turn's finish (``{"finish_reason": .., "stop_reason": ..}``): the call's answer needs it,
and the context bookkeeping of an episode's calls (offsets, observations, loss mask) then
serves both kinds of episode unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from statemachine.commands import NewTokens
from statemachine.episode_commands import request_call
from statemachine.episode_events import HARNESS_CALL, TurnRequested
from statemachine.errors import IllegalTransition, NotAnEpisode
from statemachine.events import Event, Finished
from statemachine.request import SamplingParams
from statemachine.rollout_state import RolloutState
from statemachine.status import FinishReason, Status
from statemachine.tool_calls import ToolCall


def end_turn(
    state: RolloutState,
    reason: FinishReason,
    stop_reason: int | str | None,
    *,
    tokens: NewTokens | None = None,
    now: float | None = None,
) -> list[Event]:
    """The live attempt's turn ended (``reason``, as the engine said): its last tokens, then
    the turn's end, after which the episode waits for its harness's next call (or ends, when
    a budget leaves it no next turn)."""
    if not state.harness:
        raise NotAnEpisode(state.rollout_id, state.seq + 1, "not a harness-driven episode")
    # Recorded as a call (its context bookkeeping serves both kinds of episode), named for
    # the harness, its arguments the turn's finish.
    finish = {"finish_reason": reason.value, "stop_reason": stop_reason}
    return request_call(
        state, name=HARNESS_CALL, arguments=json.dumps(finish, separators=(",", ":")),
        call_id=f"turn-{len(state.calls) + 1}", tokens=tokens, now=now,
    )  # fmt: skip


def request_turn(
    state: RolloutState, *, call_batch: str, observation_token_ids: Any, sampling: SamplingParams
) -> TurnRequested:
    """The harness's call ``call_batch`` feeds the next turn: the tokens its prompt adds to the
    episode's context, and its sampling."""
    call = state.pending_call
    if state.status is not Status.AWAITING_TOOL or call is None:
        raise IllegalTransition(
            state.rollout_id, state.seq + 1, f"no turn ended to go on from ({state.status})"
        )
    return TurnRequested(rollout_id=state.rollout_id, seq=state.seq + 1, call_id=call.call_id,
                         call_batch=call_batch, observation_token_ids=observation_token_ids,
                         sampling=sampling)  # fmt: skip


def end_session(state: RolloutState) -> list[Event]:
    """The session's end ends an episode waiting for its next call (``session_end``); one
    generating a turn, or ended, is left as it is (nothing)."""
    if not state.harness or state.status is not Status.AWAITING_TOOL:
        return []
    return [Finished(rollout_id=state.rollout_id, seq=state.seq + 1, attempt=0,
                     finish_reason=FinishReason.SESSION_END)]  # fmt: skip


def turn_finish(call: ToolCall) -> tuple[FinishReason, int | str | None]:
    """How the turn that ended at ``call`` (a harness turn's end) finished."""
    return finish_of(call.arguments)


def finish_of(arguments: str) -> tuple[FinishReason, int | str | None]:
    """A harness turn end's finish, from its call's ``arguments`` as ``end_turn`` wrote them."""
    data = json.loads(arguments)
    return FinishReason(data["finish_reason"]), data["stop_reason"]


def current_turn(state: RolloutState) -> int:
    """The turn under way, or the one that just ended at its call (0-based)."""
    last = state.calls[-1] if state.calls else None
    return last.turn if last is not None and last.result is None else len(state.calls)


def turn_batch(state: RolloutState, turn: int) -> str:
    """The call that asked for ``turn``: its batch id (the first turn's call is the episode's
    own batch, which it submitted)."""
    if turn == 0:
        return state.membership.batch_id
    fed = state.calls[turn - 1].result
    assert isinstance(fed, TurnRequested), f"turn {turn} of {state.rollout_id} was not fed"
    return fed.call_batch
