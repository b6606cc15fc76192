"""Episode commands: each returns the events that record what happened, numbered, legal, and
ending the episode where a budget, a failure or an unverified effect decides."""

from __future__ import annotations

import numpy as np
import pytest

from statemachine import (
    CallMismatch,
    ClaimMismatch,
    Event,
    Failed,
    FailureClass,
    Finished,
    FinishReason,
    IllegalTransition,
    RolloutState,
    Status,
    TokensAppended,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolEffect,
    ToolFailure,
    ToolResultRecorded,
    apply,
    commands,
)
from statemachine import (
    episode_commands as ec,
)
from statemachine.commands import NewTokens
from tests import factories as f

BEGIN = dict(worker_id="w1", weight_version=0, weight_mode="abort", model="m")


def _tokens(n: int, start: int = 100) -> NewTokens:
    return NewTokens(
        token_ids=np.arange(start, start + n, dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32),
        weight_versions=np.zeros(n, dtype=np.int64),
    )


def _all(s: RolloutState, events: list[Event]) -> RolloutState:
    for e in events:
        assert e.seq == s.seq + 1
        s = apply(s, e)
    return s


def _turn(s: RolloutState, name: str = "calc", n: int = 4, **kw: object) -> RolloutState:
    s = _all(s, commands.begin(s, **BEGIN))
    return _all(s, ec.request_call(s, name=name, arguments="{}", tokens=_tokens(n), **kw))  # type: ignore[arg-type]


def _episode(**spec: object) -> RolloutState:
    return apply(None, f.episode_submitted(**spec))


def _claimed(s: RolloutState, runner: str = "env1") -> RolloutState:
    return apply(s, ec.claim_call(s, runner))


def test_an_episode_built_by_commands_is_legal_and_numbered() -> None:
    s = _episode()
    s = _all(s, commands.begin(s, **BEGIN))
    events = ec.request_call(s, name="calc", arguments='{"a": 2}', tokens=_tokens(4))
    assert [type(e) for e in events] == [TokensAppended, ToolCallRequested]
    req = events[1]
    assert isinstance(req, ToolCallRequested)
    assert (req.call_id, req.offset, req.attempt, req.idempotency_key) == (
        "call-1",
        4,
        1,
        "r1/call-1",
    )
    s = _claimed(_all(s, events))
    assert s.status is Status.RUNNING_TOOL and s.calls[0].claims[0].claim == 1
    [result] = ec.record_result(
        s,
        call_id="call-1",
        claim=1,
        observation_token_ids=[9, 9],
        seconds=0.1,
        env_revision="rev-1",
    )
    s = apply(s, result)
    [resumed] = commands.begin(s, **BEGIN)  # the next turn is a resume from the saved context
    s = apply(s, resumed)
    assert s.status is Status.RESUMED and s.resume_prompt()[-2:] == (9, 9)
    s = _all(s, commands.finish(s, FinishReason.STOP, tokens=_tokens(2, 200)))
    assert s.status is Status.DONE and s.loss_mask.tolist() == [1, 1, 1, 1, 0, 0, 1, 1]
    assert ec.restore_revision(s) == "rev-1"


def test_a_runners_report_names_its_own_claim_and_call() -> None:
    s = _claimed(_turn(_episode()))
    s = _all(s, ec.lose_call(s, call_id="call-1", claim=1))
    s = _claimed(s, "env2")
    with pytest.raises(ClaimMismatch):
        ec.record_result(s, call_id="call-1", claim=1, observation_token_ids=[1], seconds=0.1)
    with pytest.raises(CallMismatch):
        ec.lose_call(s, call_id="call-9", claim=2)
    with pytest.raises(IllegalTransition, match="no tool call is pending"):
        ec.claim_call(_episode(), "env1")


@pytest.mark.parametrize(
    ("tool", "decision", "ends"),
    [
        ("calc", ToolEffect.IDEMPOTENT, False),
        ("edit", ToolEffect.RESTORE, False),
        ("send", ToolEffect.RESTART, True),
        ("undeclared", ToolEffect.RESTART, True),
    ],
)
def test_a_lost_runner_is_decided_by_the_tools_declared_effect(
    tool: str, decision: ToolEffect, ends: bool
) -> None:
    s = _claimed(_turn(_episode(), name=tool))
    events = ec.lose_call(s, call_id="call-1", claim=1, detail="lease expired")
    lost = events[0]
    assert isinstance(lost, ToolCallLost) and lost.decision is decision
    s = _all(s, events)
    if ends:
        assert isinstance(events[-1], Failed) and s.failure is FailureClass.EFFECT_UNVERIFIED
        assert "effect unverified" in (s.error or "")
    else:
        assert len(events) == 1 and s.status is Status.AWAITING_TOOL
        assert _claimed(s).calls[0].live_claim == 2


def test_env_errors_are_retried_within_their_budget_and_env_fatal_ends_it() -> None:
    s = _turn(_episode())
    for attempt in (1, 2):
        s = _claimed(s)
        events = ec.fail_call(
            s,
            call_id="call-1",
            claim=attempt,
            failure=ToolFailure.ENV_ERROR,
            error="timeout",
            retries=2,
        )
        assert [type(e) for e in events] == [ToolCallFailed]
        s = _all(s, events)
    s = _claimed(s)
    events = ec.fail_call(
        s, call_id="call-1", claim=3, failure=ToolFailure.ENV_ERROR, error="timeout", retries=2
    )
    s2 = _all(s, events)
    assert s2.failure is FailureClass.ENV_ERROR and "failed 3 times" in (s2.error or "")
    events = ec.fail_call(
        s, call_id="call-1", claim=3, failure=ToolFailure.ENV_FATAL, error="no such file", retries=2
    )
    s3 = _all(s, events)
    assert s3.status is Status.FAILED and s3.failure is FailureClass.ENV_FATAL


def test_max_turns_ends_the_episode_at_the_call_no_turn_could_use() -> None:
    s = _turn(_episode(max_turns=2))
    s = _claimed(s)
    s = _all(
        s, ec.record_result(s, call_id="call-1", claim=1, observation_token_ids=[5], seconds=0.1)
    )
    s = _all(s, commands.begin(s, **BEGIN))
    events = ec.request_call(s, name="calc", arguments="{}", tokens=_tokens(2, 300))
    assert isinstance(events[-1], Finished) and events[-1].attempt == 0
    s = _all(s, events)
    assert s.finish_reason is FinishReason.MAX_TURNS and len(s.calls) == 2
    assert s.calls[1].claims == () and s.pending_call is not None  # requested, never run


def test_tool_time_context_length_and_wall_time_end_the_episode_between_turns() -> None:
    # Tool time: the result that uses it up is recorded; the next call is not run.
    s = _claimed(_turn(_episode(max_tool_seconds=1.0)))
    s = _all(
        s, ec.record_result(s, call_id="call-1", claim=1, observation_token_ids=[5], seconds=1.25)
    )
    assert s.status is Status.NEXT_TURN and s.tool_seconds == 1.25
    s = _turn(s, n=1)
    assert s.finish_reason is FinishReason.TOOL_TIME
    # The context: an observation that fills max_total_tokens is recorded, then it ends.
    s = _claimed(_turn(_episode(max_total_tokens=6)))
    events = ec.record_result(
        s, call_id="call-1", claim=1, observation_token_ids=[5, 6, 7], seconds=0.1
    )
    assert [type(e) for e in events] == [ToolResultRecorded, Finished]
    s = _all(s, events)
    assert s.finish_reason is FinishReason.MAX_TOTAL_TOKENS and s.context_tokens == 7
    # The sampled budget spent exactly at a call: LENGTH.
    s = _turn(_episode(max_tokens=4))
    assert s.finish_reason is FinishReason.LENGTH
    # Wall time: the caller's clock against the submission's time.
    s = _turn(_episode(max_wall_seconds=10.0))
    assert ec.end_on_budget(s, now=s.submitted_at + 9.0) == []
    [end] = ec.end_on_budget(s, now=s.submitted_at + 10.0)
    assert isinstance(end, Finished) and end.finish_reason is FinishReason.WALL_TIME
    assert apply(s, end).status is Status.DONE
    assert ec.budget_reached(apply(None, f.submitted())) is None  # a plain rollout has none
