"""Hypothesis: any sequence of episode commands, legal or not, keeps a legal state that the log
rebuilds exactly, through the codec too, with a loss mask aligned with its context."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statemachine import (
    AT_TOOL,
    AbortReason,
    EpisodeSpec,
    Event,
    FinishReason,
    InvalidEvent,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    Status,
    Submitted,
    TokensAppended,
    ToolFailure,
    TransitionError,
    apply,
    codec,
    commands,
    fold,
)
from statemachine import episode_commands as ec
from statemachine import harness_commands as hc
from statemachine.commands import NewTokens
from statemachine.episode_events import TOOL_EVENTS
from tests import factories as f

OPS = [
    "begin",
    "tokens",
    "request",
    "claim",
    "result",
    "fail",
    "lose",
    "abort",
    "budget",
    "finish",
    "cancel",
    "fail_rollout",
]
# What a caller would plausibly do in each state, so that histories grow long (many turns,
# retries, lost runners); any command at all is drawn too, and must be refused or legal.
PLAUSIBLE = {
    Status.PENDING: ["begin"],
    Status.GENERATING: ["tokens", "tokens", "request", "request", "abort"],
    Status.RESUMED: ["tokens", "tokens", "request", "request", "abort"],
    Status.ABORTED: ["begin"],
    Status.AWAITING_TOOL: ["claim", "claim", "claim", "budget"],
    Status.RUNNING_TOOL: ["result", "result", "result", "fail", "lose"],
    Status.NEXT_TURN: ["begin", "begin", "begin", "budget"],
}


@st.composite
def submission(draw: st.DrawFn) -> Submitted:
    spec = f.episode(
        max_turns=draw(st.none() | st.integers(2, 6)),  # 1 ends every history at once
        max_total_tokens=draw(st.none() | st.integers(4, 80)),
        max_tool_seconds=draw(st.none() | st.sampled_from([0.5, 1.0, 3.0])),
        max_wall_seconds=draw(st.none() | st.just(10.0)),
    )
    assert isinstance(spec, EpisodeSpec)
    request = RolloutRequest(
        prompt_token_ids=(1, 2),
        episode=spec,
        sampling=SamplingParams(max_tokens=draw(st.integers(1, 60))),
    )
    return Submitted(rollout_id="r", seq=1, at=0.0, request=request)


def _tokens(draw: st.DrawFn, s: RolloutState, most: int = 6) -> NewTokens:
    n = draw(st.integers(1, most))
    version = draw(st.integers(0, 3))
    return NewTokens(
        token_ids=np.arange(s.num_tokens, s.num_tokens + n, dtype=np.int32) + 100,
        logprobs=np.full(n, -0.25, dtype=np.float32),
        weight_versions=np.full(n, version, dtype=np.int64),
    )


def _runner_view(draw: st.DrawFn, s: RolloutState) -> dict[str, Any]:
    """The call and claim a runner reports on: usually the live ones, sometimes a stale or
    future claim, or another call (a zombie, or a runner of another rollout's call)."""
    call = s.pending_call
    call_id = call.call_id if call is not None else "call-1"
    claim = call.live_claim if call is not None else 1
    shift = draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
    if draw(st.integers(0, 9)) == 0:
        call_id = "call-99"
    return {"call_id": call_id, "claim": max(1, claim + shift)}


@st.composite
def command(draw: st.DrawFn, s: RolloutState, op: str | None = None) -> list[Event]:
    """The events of one drawn command aimed at ``s`` (``op``, else one drawn); raises a
    ``TransitionError`` (or ``InvalidEvent``) when the command is illegal there, as the real
    caller would see."""
    plausible = draw(st.integers(0, 9)) > 0
    if op is None:
        op = draw(st.sampled_from(PLAUSIBLE[s.status] if plausible else OPS))
    now = draw(st.sampled_from([None, None, None, None, None, 5.0, 15.0]))  # wall: 10 s
    maybe = (lambda: _tokens(draw, s)) if draw(st.booleans()) else (lambda: None)
    if op == "begin":
        return commands.begin(
            s, worker_id="w", weight_version=draw(st.integers(0, 3)), weight_mode="abort", model="m"
        )
    if op == "tokens":
        return [commands.checkpoint(s, _tokens(draw, s))]
    if op == "finish":
        return commands.finish(
            s, draw(st.sampled_from([FinishReason.STOP, FinishReason.LENGTH])), tokens=maybe()
        )
    if op == "abort":
        return commands.abort(s, draw(st.sampled_from(list(AbortReason))), tokens=maybe())
    if op == "request":
        used = draw(st.sampled_from([None, None, None, "call-1"]))  # sometimes an id reused
        return ec.request_call(
            s,
            name=draw(st.sampled_from(["calc", "edit", "send", "other"])),
            arguments="{}",
            call_id=used,
            tokens=maybe(),
            now=now,
        )
    if op == "claim":
        return [ec.claim_call(s, draw(st.sampled_from(["e1", "e2"])))]
    if op == "result":
        obs = np.arange(draw(st.integers(0, 5)), dtype=np.int32) + 900
        return ec.record_result(
            s,
            **_runner_view(draw, s),
            observation_token_ids=obs,
            seconds=draw(st.sampled_from([0.0, 0.25, 1.0])),
            now=now,
        )
    if op == "fail":
        return ec.fail_call(
            s,
            **_runner_view(draw, s),
            failure=draw(st.sampled_from(ToolFailure)),
            error="e",
            retries=draw(st.integers(0, 2)),
            seconds=draw(st.sampled_from([0.0, 0.5])),
            now=now,
        )
    if op == "lose":
        return ec.lose_call(s, **_runner_view(draw, s), now=now)
    if op == "budget":
        return ec.end_on_budget(s, now)
    if op == "cancel":
        return [commands.cancel(s, "trainer")]
    return [commands.fail(s, "boom")]


def check_invariants(s: RolloutState) -> None:
    pending = s.pending_call
    if s.status in AT_TOOL:
        assert pending is not None
        assert (pending.live_claim != 0) == (s.status is Status.RUNNING_TOOL)
    elif s.status is Status.NEXT_TURN:
        assert s.calls and s.calls[-1].result is not None
    elif not s.terminal:
        assert pending is None
    for i, call in enumerate(s.calls):
        assert [c.claim for c in call.claims] == list(range(1, len(call.claims) + 1))
        assert all(c.end is not None for c in call.claims[:-1])
        assert i == len(s.calls) - 1 or (call.result is not None and call.live_claim == 0)
    if s.harness:  # its max_tokens is each turn's, as each call asked
        assert s.turn_sampled <= s.turn_sampling.max_tokens
    else:
        assert s.num_tokens <= s.request.sampling.max_tokens
    # The loss mask is aligned with the context and counts each sampled token once.
    ids, mask = s.context_token_ids, s.loss_mask
    versions, lps = s.context_weight_versions, s.context_logprobs
    assert ids.shape == mask.shape == versions.shape == lps.shape
    assert ids.shape[0] == s.num_tokens + s.observation_tokens == s.context_tokens
    assert int(mask.sum()) == s.num_tokens
    assert ids[mask == 1].tolist() == s.token_ids.tolist()
    observed = [
        t for c in s.calls if c.result is not None for t in c.result.observation_token_ids.tolist()
    ]
    assert ids[mask == 0].tolist() == observed
    assert (versions[mask == 0] == -1).all() and (versions[mask == 1] >= 0).all()
    # Turns tile the sampled tokens: in order, disjoint, each span all sampled.
    spans = s.turns
    assert sum(end - start for start, end in spans) == s.num_tokens
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    assert all(mask[start:end].all() for start, end in spans)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(submission(), st.data())
def test_any_command_sequence_keeps_a_legal_state_the_log_rebuilds(
    sub: Submitted, data: st.DataObject
) -> None:
    run_history(sub, data, command)


HARNESS_OPS = ["begin", "tokens", "turn_end", "feed", "abort", "budget", "session_end",
               "cancel", "fail_rollout", "claim", "finish"]  # fmt: skip
HARNESS_PLAUSIBLE = {
    Status.PENDING: ["begin"],
    Status.GENERATING: ["tokens", "tokens", "turn_end", "turn_end", "abort"],
    Status.RESUMED: ["tokens", "tokens", "turn_end", "turn_end", "abort"],
    Status.ABORTED: ["begin"],
    Status.AWAITING_TOOL: ["feed", "feed", "feed", "session_end", "budget"],
    Status.NEXT_TURN: ["begin", "begin", "begin", "budget"],
}


@st.composite
def harness_submission(draw: st.DrawFn) -> Submitted:
    spec = EpisodeSpec(
        harness=True,
        max_turns=draw(st.none() | st.integers(2, 6)),
        max_total_tokens=draw(st.none() | st.integers(4, 80)),
        max_wall_seconds=draw(st.none() | st.just(10.0)),
    )
    request = RolloutRequest(
        prompt_token_ids=(1, 2), episode=spec,
        sampling=SamplingParams(max_tokens=draw(st.integers(1, 12))),
    )  # fmt: skip
    return Submitted(rollout_id="r", seq=1, at=0.0, request=request)


@st.composite
def harness_command(draw: st.DrawFn, s: RolloutState) -> list[Event]:
    """A harness-driven episode's commands (its harness's calls feed its turns), any of the
    others drawn now and then, which must be refused or legal as well."""
    plausible = draw(st.integers(0, 9)) > 0
    op = draw(st.sampled_from(HARNESS_PLAUSIBLE[s.status] if plausible else HARNESS_OPS))
    now = draw(st.sampled_from([None, None, None, 5.0, 15.0]))
    if op == "turn_end":
        tokens = _tokens(draw, s, most=3) if draw(st.booleans()) else None
        reason = draw(st.sampled_from([FinishReason.STOP, FinishReason.LENGTH]))
        return hc.end_turn(s, reason, 7 if reason is FinishReason.STOP else None,
                           tokens=tokens, now=now)  # fmt: skip
    if op == "feed":
        # Usually the episode's top-k; now and then another (refused: TopLogprobsMismatch).
        k = draw(st.sampled_from([0, 0, 0, 0, 1]))
        sampling = SamplingParams(max_tokens=draw(st.integers(1, 12)), logprobs=k)
        obs = np.arange(draw(st.integers(0, 4)), dtype=np.int32) + 900
        return [hc.request_turn(s, call_batch=f"call-{len(s.calls)}",
                                observation_token_ids=obs, sampling=sampling)]  # fmt: skip
    if op == "session_end":
        return hc.end_session(s)
    return draw(command(s, op))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(harness_submission(), st.data())
def test_any_harness_driven_sequence_keeps_a_legal_state_the_log_rebuilds(
    sub: Submitted, data: st.DataObject
) -> None:
    run_history(sub, data, harness_command)


def run_history(sub: Submitted, data: st.DataObject, draw_command: Any) -> None:
    """Apply drawn commands to ``sub``'s rollout, refused ones changing nothing; check the
    invariants after each, and fold, codec and snapshot at the end."""
    state = apply(None, sub)
    accepted: list[Event] = [sub]
    budget = sub.request.episode.max_total_tokens  # type: ignore[union-attr]
    for _ in range(data.draw(st.integers(1, 60))):
        if state.terminal:
            break
        try:
            chain = data.draw(draw_command(state))
            after = state
            for e in chain:
                after = apply(after, e)
        except (TransitionError, InvalidEvent):
            # Refused, whole (a chain is one transaction in the store): nothing changes.
            continue
        state = after
        accepted.extend(chain)
        check_invariants(state)
        if budget is not None and any(isinstance(e, TokensAppended) for e in chain):
            assert state.context_tokens <= budget  # sampling never overruns the context
    # Shown by --hypothesis-show-statistics: how far the histories reach.
    why = state.finish_reason or state.failure
    event(f"ends {state.status.value} ({why}), {len(state.calls)} calls")
    assert fold(accepted) == state
    decoded = [codec.decode(codec.encode(e), rollout_id=e.rollout_id, seq=e.seq) for e in accepted]
    assert decoded == accepted
    first = decoded[0]
    assert isinstance(first, Submitted)
    chunks = tuple(e for e in decoded if isinstance(e, TokensAppended))
    tools = [e for e in decoded if isinstance(e, TOOL_EVENTS)]
    assert codec.decode_snapshot(codec.encode_snapshot(state), first, chunks, tools) == state
