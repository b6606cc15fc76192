"""An episode's edges and every refusal of its tool-call events (the table itself is walked
exhaustively in test_transitions), and the context, loss mask and turns derived from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from statemachine import (
    AT_TOOL,
    LIVE,
    TERMINAL,
    WAITING,
    AttemptMismatch,
    BudgetExceeded,
    CallMismatch,
    ClaimEnd,
    ClaimMismatch,
    DecisionMismatch,
    Event,
    FinishReason,
    IllegalTransition,
    NotAnEpisode,
    OffsetMismatch,
    RolloutState,
    Status,
    ToolEffect,
    TransitionError,
    apply,
)
from tests import factories as f


def run(s: RolloutState | None, *steps: Callable[..., Event] | Event) -> RolloutState:
    for step in steps:
        assert s is not None or isinstance(step, Event)
        s = apply(s, step if isinstance(step, Event) else step(s))
    assert s is not None
    return s


def at_tool(**spec: Any) -> RolloutState:
    """An episode whose first turn (4 tokens) ended at a call of ``calc``."""
    return run(apply(None, f.episode_submitted(**spec)), f.started, f.tokens, f.requested)


def refused(s: RolloutState, event: Event, error: type[TransitionError]) -> None:
    with pytest.raises(error):
        apply(s, event)


def test_the_tool_states_sit_in_neither_live_nor_waiting() -> None:
    assert {Status.AWAITING_TOOL, Status.RUNNING_TOOL} == AT_TOOL
    assert AT_TOOL.isdisjoint(LIVE | WAITING | TERMINAL)
    assert Status.NEXT_TURN in WAITING and Status.NEXT_TURN not in LIVE


def test_a_three_turn_episode_feeds_its_observations_between_its_turns() -> None:
    s = at_tool()
    assert s.status is Status.AWAITING_TOOL and s.live_attempt == 0
    call = s.pending_call
    assert call is not None and (call.call_id, call.offset, call.turn, call.live_claim) == (
        "c1",
        4,
        0,
        0,
    )
    s = run(s, f.claimed)
    assert s.status is Status.RUNNING_TOOL and s.pending_call.live_claim == 1  # type: ignore[union-attr]
    s = run(s, lambda s: f.result(s, n=3, seconds=0.5))
    assert s.status is Status.NEXT_TURN and s.pending_call is None
    assert s.calls[0].claims[0].end is ClaimEnd.RESULT
    s = run(s, lambda s: f.resumed(s, version=1), lambda s: f.tokens(s, n=2, version=1))
    s = run(s, f.requested, f.claimed, lambda s: f.result(s, n=2, seconds=0.25))
    s = run(s, lambda s: f.resumed(s, version=2), lambda s: f.tokens(s, n=3, version=2))
    s = run(s, lambda s: f.finished(s, FinishReason.STOP))
    assert s.status is Status.DONE and s.num_tokens == 9 and s.attempt == 3
    sampled = list(range(100, 109))
    assert s.context_token_ids.tolist() == [
        *sampled[:4],
        900,
        901,
        902,
        *sampled[4:6],
        900,
        901,
        *sampled[6:],
    ]
    assert s.loss_mask.tolist() == [1] * 4 + [0] * 3 + [1] * 2 + [0] * 2 + [1] * 3
    assert s.context_weight_versions.tolist() == [0] * 4 + [-1] * 3 + [1] * 2 + [-1] * 2 + [2] * 3
    lps = s.context_logprobs
    assert (lps[s.loss_mask == 0] == 0).all() and lps[s.loss_mask == 1].tolist() == (
        s.logprobs.tolist()
    )
    assert s.turns == ((0, 4), (7, 9), (11, 14))
    assert (s.tool_seconds, s.observation_tokens, s.context_tokens) == (0.75, 5, 14)
    assert s.token_ids.tolist() == sampled  # sampled tokens only, offsets unchanged


def test_a_resume_sends_the_context_byte_for_byte_and_budgets_count_it() -> None:
    s = run(at_tool(max_total_tokens=12), f.claimed, lambda s: f.result(s, n=3))
    assert s.resume_prompt() == (1, 2, 3, 100, 101, 102, 103, 900, 901, 902)
    # 4 sampled + 3 observed of 12: 5 left for sampling, though max_tokens leaves 60.
    assert s.remaining_tokens == 5 and s.resume_sampling().max_tokens == 5
    s = run(s, f.resumed)
    refused(s, f.tokens(s, n=6), BudgetExceeded)
    s = run(s, lambda s: f.tokens(s, n=5))
    assert s.context_tokens == 12


def test_an_abort_mid_turn_resumes_the_same_turn() -> None:
    s = run(at_tool(), f.claimed, f.result, f.resumed, lambda s: f.tokens(s, n=2), f.aborted)
    assert s.status is Status.ABORTED and s.turns == ((0, 4), (7, 9))
    s = run(s, f.resumed, lambda s: f.tokens(s, n=1))
    assert s.turns == ((0, 4), (7, 10)) and len(s.calls) == 1


def test_env_errors_and_lost_runners_leave_the_call_for_a_new_claim() -> None:
    s = run(at_tool(), f.claimed, lambda s: f.call_failed(s, seconds=1.5))
    assert s.status is Status.AWAITING_TOOL and s.tool_seconds == 1.5
    s = run(s, lambda s: f.claimed(s, runner="env2"), f.call_lost)
    assert s.status is Status.AWAITING_TOOL
    s = run(s, lambda s: f.claimed(s, runner="env3"), f.result)
    [call] = s.calls
    assert [(c.claim, c.runner_id, c.end) for c in call.claims] == [
        (1, "env1", ClaimEnd.FAILED),
        (2, "env2", ClaimEnd.LOST),
        (3, "env3", ClaimEnd.RESULT),
    ]
    assert call.claims[1].decision is ToolEffect.IDEMPOTENT and call.unverified == 1
    assert s.tool_seconds == 2.0  # 1.5 failing + 0.5 for the result


def test_a_zombie_runners_late_result_is_refused_by_its_claim() -> None:
    s = run(at_tool(), f.claimed, f.call_lost, lambda s: f.claimed(s, runner="env2"))
    refused(s, f.result(s, claim=1), ClaimMismatch)  # the lost runner reports late
    refused(s, f.call_failed(s, claim=1), ClaimMismatch)
    refused(s, f.call_lost(s, claim=3), ClaimMismatch)
    assert run(s, f.result).status is Status.NEXT_TURN  # the live claim still may


def test_tool_events_are_refused_for_another_call_or_claim() -> None:
    s = at_tool()
    refused(s, f.claimed(s, call_id="c9"), CallMismatch)
    refused(s, f.claimed(s, claim=2), ClaimMismatch)  # claims count 1, 2, ... without gaps
    refused(s, f.result(s), IllegalTransition)  # a result without a claim
    s = run(s, f.claimed)
    refused(s, f.claimed(s), IllegalTransition)  # a second claim over a live one
    refused(s, f.result(s, call_id="c9"), CallMismatch)
    refused(s, f.call_lost(s, decision=ToolEffect.RESTART), DecisionMismatch)
    s = run(s, f.result, f.resumed, f.tokens)
    refused(s, f.requested(s, call_id="c1"), CallMismatch)  # call ids are unique
    refused(s, f.requested(s, offset=s.num_tokens - 1), OffsetMismatch)
    refused(s, f.requested(s, attempt=s.attempt - 1), AttemptMismatch)


def test_a_plain_rollout_refuses_tool_events_and_episode_reasons() -> None:
    s = run(apply(None, f.submitted()), f.started, f.tokens)
    refused(s, f.requested(s), NotAnEpisode)
    refused(s, f.finished(s, FinishReason.MAX_TURNS), NotAnEpisode)


def test_budgets_refuse_a_step_that_would_begin_beyond_them() -> None:
    s = run(at_tool(max_turns=1), f.claimed, f.result)
    refused(s, f.resumed(s), BudgetExceeded)  # turn 2 of 1
    s = run(at_tool(max_tool_seconds=1.0), f.claimed, lambda s: f.call_failed(s, seconds=1.0))
    refused(s, f.claimed(s), BudgetExceeded)  # no tool time left for a retry
    s = run(at_tool(max_total_tokens=7), f.claimed, lambda s: f.result(s, n=3))
    refused(s, f.resumed(s), BudgetExceeded)  # 4 + 3 tokens fill the context
    # What a budget does allow: end the episode between turns, naming no attempt.
    done = run(s, lambda s: f.budget_finished(s, FinishReason.MAX_TOTAL_TOKENS))
    assert done.status is Status.DONE and done.finish_reason is FinishReason.MAX_TOTAL_TOKENS


def test_between_turns_only_a_budget_ends_the_episode_and_no_attempt_writes() -> None:
    for s in (at_tool(), run(at_tool(), f.claimed, f.result)):
        refused(s, f.finished(s, FinishReason.MAX_TURNS), AttemptMismatch)  # its old attempt
        refused(s, f.budget_finished(s, FinishReason.STOP), IllegalTransition)
        refused(s, f.tokens(s), IllegalTransition)
        for reason in (FinishReason.LENGTH, FinishReason.WALL_TIME, FinishReason.TOOL_TIME):
            assert run(s, lambda s, r=reason: f.budget_finished(s, r)).status is Status.DONE


def test_a_refused_event_changes_nothing() -> None:
    s = run(at_tool(), f.claimed)
    before = dataclasses.replace(s)
    refused(s, f.result(s, claim=2), ClaimMismatch)
    assert s == before and s.calls[0].live_claim == 1


def test_observations_must_be_token_ids() -> None:
    s = run(at_tool(), f.claimed)
    with pytest.raises(ValueError, match="observation token ids must be >= 0"):
        f.result(s, observation_token_ids=np.array([1, -2]))
    # Not wrapped into int32 (2**31 would have been stored as -2**31, passing the check above).
    with pytest.raises(ValueError, match="outside int32"):
        f.result(s, observation_token_ids=[1, 2**31])
    with pytest.raises(ValueError, match="outside int32"):
        f.result(s, observation_token_ids=np.array([2**32 + 5], dtype=np.uint64))
    with pytest.raises(ValueError, match="seconds"):
        f.result(s, seconds=float("nan"))
    empty = run(s, lambda s: f.result(s, n=0))  # a tool may say nothing
    assert empty.context_token_ids.tolist() == [100, 101, 102, 103]
