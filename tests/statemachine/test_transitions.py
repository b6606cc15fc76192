"""The transition table, walked exhaustively, and every check ``apply`` makes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from statemachine import (
    EVENT_TYPES,
    LIVE,
    TERMINAL,
    TRANSITIONS,
    AbortReason,
    AttemptMismatch,
    BudgetExceeded,
    FinishReason,
    IllegalTransition,
    InvalidEvent,
    InvalidRequest,
    OffsetMismatch,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    SequenceGap,
    Status,
    TokensAppended,
    TopLogprobsMismatch,
    apply,
    fold,
)
from tests import factories as f


def state_in(status: Status | None, harness: bool = False) -> RolloutState | None:
    """A real state in ``status``, reached through legal events only; with ``harness``, of a
    harness-driven episode (whose next turn its harness feeds: no runner claims its calls, so
    ``running_tool`` is an environment episode's state even then)."""
    if status is None:
        return None
    # An episode's request, so that every tool-call event is possible where the table allows
    # it; a plain rollout's refusal of them is tested on its own.
    if harness and status is not Status.RUNNING_TOOL:
        s = apply(None, f.harness_submitted(max_tokens=16))
        turn = [f.started, f.tokens, lambda s: f.requested(s, "harness")]
        path = {Status.AWAITING_TOOL: turn, Status.NEXT_TURN: [*turn, f.turn_requested]}
        for make in path.get(status, []):
            s = apply(s, make(s))
        if status in path:
            assert s.status is status
            return s
    s = apply(None, f.episode_submitted(max_tokens=16))
    turn = [f.started, f.tokens, f.requested]
    path = {
        Status.PENDING: [],
        Status.GENERATING: [f.started],
        Status.ABORTED: [f.started, f.tokens, f.aborted],
        Status.RESUMED: [f.started, f.tokens, f.aborted, f.resumed],
        Status.DONE: [f.started, f.finished],
        Status.FAILED: [f.failed],
        Status.CANCELLED: [f.cancelled],
        Status.AWAITING_TOOL: turn,
        Status.RUNNING_TOOL: [*turn, f.claimed],
        Status.NEXT_TURN: [*turn, f.claimed, f.result],
    }[status]
    for make in path:
        s = apply(s, make(s))
    assert s.status is status
    return s


def event_for(state: RolloutState | None, event_type: type) -> object:
    """An event of ``event_type`` that is well-formed for ``state`` in every respect but the
    transition itself, so the table alone decides whether it is accepted."""
    if event_type.__name__ == "Submitted":
        return (
            f.submitted()
            if state is None
            else f.submitted().__class__(
                rollout_id=state.rollout_id, seq=state.seq + 1, request=state.request
            )
        )
    if state is None:
        # No rollout yet: the same event as for a pending one, but as the very first record.
        return dataclasses.replace(event_for(state_in(Status.GENERATING), event_type), seq=1)  # type: ignore[type-var]
    return {
        "Started": lambda s: f.started(s),
        "Resumed": lambda s: f.resumed(s),
        "TokensAppended": lambda s: f.tokens(s, n=1),
        "Aborted": lambda s: f.aborted(s),
        # Between turns no attempt runs: a Finished there names attempt 0 and a budget.
        "Finished": lambda s: f.budget_finished(s) if s.live_attempt == 0 else f.finished(s),
        "Failed": lambda s: f.failed(s),
        "Cancelled": lambda s: f.cancelled(s),
        "ToolCallRequested": lambda s: f.requested(s, attempt=max(1, s.attempt)),
        "ToolCallClaimed": lambda s: f.claimed(s),
        "ToolResultRecorded": lambda s: f.result(s),
        "ToolCallFailed": lambda s: f.call_failed(s),
        "ToolCallLost": lambda s: f.call_lost(s),
        "TurnRequested": lambda s: (
            f.turn_requested(s) if s.pending_call else f.turn_requested(s, call_id="turn-1")
        ),
    }[event_type.__name__](state)


@pytest.mark.parametrize("status", [None, *Status], ids=lambda s: str(s or "new"))
@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
def test_every_state_event_pair(status: Status | None, event_type: type) -> None:
    # A harness's next turn is tried on a harness-driven episode (an environment episode
    # refuses it: NotAnEpisode, tested on its own).
    state = state_in(status, harness=event_type.__name__ == "TurnRequested")
    event = event_for(state, event_type)
    expected = TRANSITIONS.get((status, event_type))
    if expected is None:
        with pytest.raises(IllegalTransition):
            apply(state, event)  # type: ignore[arg-type]
    else:
        after = apply(state, event)  # type: ignore[arg-type]
        assert after.status is expected
        assert after.seq == (state.seq + 1 if state else 1)


def test_terminal_states_have_no_exits_and_sets_are_disjoint() -> None:
    assert {s for (s, _) in TRANSITIONS if s in TERMINAL} == set()
    assert TERMINAL.isdisjoint(LIVE)
    assert {Status.DONE, Status.FAILED, Status.CANCELLED} == TERMINAL
    # Every non-terminal state can still reach an end.
    for s in set(Status) - TERMINAL:
        assert any(src is s and dst in TERMINAL for (src, _), dst in TRANSITIONS.items())


def test_sequence_gap_and_foreign_rollout_refused() -> None:
    s = state_in(Status.GENERATING)
    assert s is not None
    with pytest.raises(SequenceGap):
        apply(s, f.tokens(s, seq=s.seq + 2))
    with pytest.raises(SequenceGap):
        apply(s, f.tokens(s, seq=s.seq))
    other = f.submitted("other")
    with pytest.raises(IllegalTransition):
        apply(s, other.__class__(rollout_id="other", seq=s.seq + 1, request=other.request))


def test_offset_budget_and_attempt_checks() -> None:
    s = state_in(Status.GENERATING)
    assert s is not None
    s = apply(s, f.tokens(s, n=10))
    with pytest.raises(OffsetMismatch):
        apply(s, f.tokens(s, n=1, offset=9))
    with pytest.raises(OffsetMismatch):
        apply(s, f.tokens(s, n=1, offset=11))
    with pytest.raises(BudgetExceeded):
        apply(s, f.tokens(s, n=7))  # 10 + 7 > 16
    with pytest.raises(AttemptMismatch):
        apply(s, f.tokens(s, n=1, attempt=2))
    full = apply(s, f.tokens(s, n=6))
    assert full.num_tokens == 16 and full.remaining_tokens == 0
    with pytest.raises(AttemptMismatch):
        apply(full, f.aborted(full, attempt=0))
    bad_start = f.started(state_in(Status.PENDING))  # type: ignore[arg-type]
    with pytest.raises(AttemptMismatch):
        apply(
            state_in(Status.PENDING),
            bad_start.__class__(rollout_id="r1", seq=2, attempt=2, worker_id="w", weight_version=0),
        )


def test_derived_values_across_an_abort_and_resume() -> None:
    s = apply(None, f.submitted(max_tokens=10, min_tokens=6, prompt=(7, 8)))
    s = apply(s, f.started(s, version=3))
    s = apply(s, f.tokens(s, [11, 12], version=3, routes=True))
    s = apply(s, f.tokens(s, [13], version=3, routes=True))
    s = apply(s, f.aborted(s, AbortReason.WEIGHT_UPDATE))
    assert s.status is Status.ABORTED and s.live_attempt == 0 and s.aborts == 1
    assert s.resume_prompt() == (7, 8, 11, 12, 13)
    rs = s.resume_sampling()
    assert (rs.max_tokens, rs.min_tokens) == (7, 3)
    s = apply(s, f.resumed(s, version=4))
    assert s.live_attempt == 2 and s.weight_version == 4
    s = apply(s, f.tokens(s, [14, 15], version=4, routes=True))
    s = apply(s, f.finished(s, FinishReason.STOP))
    assert s.token_ids.tolist() == [11, 12, 13, 14, 15]
    assert s.weight_versions.tolist() == [3, 3, 3, 4, 4]
    assert s.logprobs.dtype == np.float32 and s.logprobs.shape == (5,)
    routes = s.routed_experts
    assert routes is not None and routes.shape == (5, 2, 2) and routes.dtype == np.uint8
    assert s.terminal and s.finish_reason is FinishReason.STOP


def test_top_logprobs_are_recorded_per_token_across_attempts_and_only_as_asked() -> None:
    s = apply(None, f.submitted(max_tokens=8, logprobs=3))
    s = apply(s, f.started(s))
    before = s
    # A chunk of another width, or none at all, is refused and changes nothing.
    for width in (0, 2, 4):
        with pytest.raises(TopLogprobsMismatch, match=f"top-{width} logprobs; the request asked"):
            apply(s, f.tokens(s, [1, 2], top=width))
    assert s is before and s.num_tokens == 0
    s = apply(s, f.tokens(s, [1, 2]))
    s = apply(s, f.aborted(s))
    s = apply(s, f.resumed(s))
    s = apply(s, f.tokens(s, [3]))
    top_ids, top_lps = s.top_token_ids, s.top_logprobs
    assert top_ids is not None and top_lps is not None
    assert top_ids.shape == top_lps.shape == (3, 3) and top_ids.dtype == np.int32
    assert top_ids.tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert top_lps.dtype == np.float32
    # Asked for but nothing generated yet: empty [0, k]; never asked: None.
    fresh = apply(None, f.submitted(max_tokens=8, logprobs=2))
    assert fresh.top_token_ids is not None and fresh.top_token_ids.shape == (0, 2)
    plain = state_in(Status.GENERATING)
    assert plain is not None and plain.top_token_ids is None and plain.top_logprobs is None
    with pytest.raises(
        TopLogprobsMismatch, match="top-1 logprobs; the request asked for logprobs=0"
    ):
        apply(plain, f.tokens(plain, [1], top=1))


def test_tokens_refuse_malformed_top_arrays() -> None:
    s = state_in(Status.GENERATING)
    assert s is not None
    base = dict(rollout_id=s.rollout_id, seq=s.seq + 1, attempt=1, offset=0,
                token_ids=[1, 2], logprobs=[-1.0, -2.0], weight_versions=[0, 0])  # fmt: skip
    bad = [
        ({"top_token_ids": [[1], [2]]}, "come together"),
        ({"top_token_ids": [[1], [2]], "top_logprobs": [[-1.0]]}, "must be \\[2, k\\]"),
        ({"top_token_ids": [[1, 2]], "top_logprobs": [[-1.0, -2.0]]}, "must be \\[2, k\\]"),
        ({"top_token_ids": [[-1], [2]], "top_logprobs": [[-1.0], [0.0]]}, ">= 0"),
        ({"top_token_ids": [1, 2], "top_logprobs": [-1.0, 0.0]}, "2-D"),
        ({"top_token_ids": np.zeros((2, 0)), "top_logprobs": np.zeros((2, 0))}, "k >= 1"),
    ]
    for extra, message in bad:
        with pytest.raises(InvalidEvent, match=message):
            TokensAppended(**base, **extra)


def test_events_refuse_malformed_arrays() -> None:
    s = state_in(Status.GENERATING)
    assert s is not None
    base = {"rollout_id": "r1", "seq": 3, "attempt": 1, "offset": 0}
    with pytest.raises(InvalidEvent):
        TokensAppended(**base, token_ids=[1, 2], logprobs=[-1.0], weight_versions=[0, 0])
    with pytest.raises(InvalidEvent):
        TokensAppended(**base, token_ids=[], logprobs=[], weight_versions=[])
    with pytest.raises(InvalidEvent):
        TokensAppended(**base, token_ids=[-1], logprobs=[-1.0], weight_versions=[0])
    with pytest.raises(InvalidEvent):
        TokensAppended(**base, token_ids=[1.5], logprobs=[-1.0], weight_versions=[0])
    with pytest.raises(InvalidEvent):
        TokensAppended(
            **base,
            token_ids=[1],
            logprobs=[-1.0],
            weight_versions=[0],
            routed_experts=np.zeros((2, 1, 1), dtype=np.uint8),
        )
    with pytest.raises(InvalidEvent):
        TokensAppended(
            **base,
            token_ids=[1],
            logprobs=[-1.0],
            weight_versions=[0],
            routed_experts=np.full((1, 1, 1), -3),
        )


def test_events_are_immutable_including_their_arrays() -> None:
    s = state_in(Status.GENERATING)
    assert s is not None
    e = f.tokens(s, n=3, routes=True)
    with pytest.raises(ValueError, match="read-only"):
        e.token_ids[0] = 5
    with pytest.raises(AttributeError):
        e.offset = 3  # type: ignore[misc]
    assert e.routed_experts is not None and e.routed_experts.dtype == np.uint8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 4, "min_tokens": 5},
        {"max_tokens": 4, "temperature": -1},
        {"max_tokens": 4, "top_p": 0.0},
        {"max_tokens": 4, "top_p": 1.5},
        {"max_tokens": 4, "top_k": -2},
        {"max_tokens": True},
        {"max_tokens": 4, "stop": ("",)},
        {"max_tokens": 4, "stop_token_ids": (-1,)},
        {"max_tokens": 4, "temperature": float("nan")},
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused() -> None:
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequest):
        RolloutRequest(prompt_token_ids=(), sampling=sp)
    with pytest.raises(InvalidRequest):
        RolloutRequest(prompt_token_ids=(1, -2), sampling=sp)
    for bad in ({"x": {1, 2}}, {"x": b"raw"}, {"x": [object()]}, {"x": {3: 1}},
                {"x": float("nan")}, {"x": 2**64}):  # fmt: skip
        with pytest.raises(InvalidRequest, match="metadata"):
            RolloutRequest(prompt_token_ids=(1,), sampling=sp, metadata=bad)
    nested = RolloutRequest(prompt_token_ids=(1,), sampling=sp,
                            metadata={"x": (1, {"y": [2.5, None]}), "z": "s"})  # fmt: skip
    assert nested.metadata == {"x": [1, {"y": [2.5, None]}], "z": "s"}
    assert RolloutRequest.from_dict(nested.to_dict()).to_dict() == nested.to_dict()
    with pytest.raises(InvalidRequest, match="unknown sampling"):
        RolloutRequest.from_dict(
            {"prompt_token_ids": [1], "sampling": {"max_tokens": 2, "tempreature": 1}}
        )
    with pytest.raises(InvalidRequest, match="missing"):
        RolloutRequest.from_dict({"sampling": {"max_tokens": 2}})


def test_fold_equals_stepwise_apply() -> None:
    sub = f.submitted()
    s0 = apply(None, sub)
    s1 = apply(s0, f.started(s0))
    s2 = apply(s1, f.tokens(s1))
    done = f.finished(s2)
    events = [sub, f.started(s0), s2.chunks[0], done]
    assert fold(events) == apply(s2, done)


def test_statemachine_imports_no_io_or_ml_libraries() -> None:
    forbidden = ["redis", "rq", "aiohttp", "torch", "transformers", "vllm", "fakeredis"]
    code = (
        "import sys, statemachine, statemachine.codec, statemachine.transitions\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_attempt_on_another_model_is_refused_and_changes_nothing() -> None:
    from statemachine import ModelMismatch

    s = apply(None, f.submitted("r"))
    s = apply(s, f.started(s, model="qwen3_moe:aaa"))
    s = apply(s, f.tokens(s))
    s = apply(s, f.aborted(s))
    assert s.model == "qwen3_moe:aaa"
    with pytest.raises(ModelMismatch, match="would run model 'qwen3:bbb'"):
        apply(s, f.resumed(s, model="qwen3:bbb"))
    # The same model resumes; an unrecorded model ("": written before models were recorded,
    # or a deployment that cannot name it) cannot be checked and is let through.
    assert apply(s, f.resumed(s, model="qwen3_moe:aaa")).model == "qwen3_moe:aaa"
    assert apply(s, f.resumed(s, model="")).model == "qwen3_moe:aaa"
    unknown = apply(apply(None, f.submitted("u")), f.started(apply(None, f.submitted("u"))))
    assert unknown.model == ""


def test_evolve_is_replace() -> None:
    # evolve is apply's fast dataclasses.replace: the same state, every field carried over,
    # and a misspelt field refused rather than dropped.
    s = apply(None, f.submitted("r1", max_tokens=8))
    s = apply(s, f.started(s))
    changes = {"seq": 9, "num_tokens": 3, "worker_id": "w9", "error": "x"}
    assert s.evolve(**changes) == dataclasses.replace(s, **changes)
    assert s.evolve() == s and s.evolve() is not s
    with pytest.raises(TypeError, match="no field 'sequence'"):
        s.evolve(sequence=3)
