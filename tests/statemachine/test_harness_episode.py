"""A harness-driven episode in the domain: each of its harness's calls is a turn. A turn ends
wherever its generation ends and records that end; the next call feeds the tokens its prompt
adds and its own sampling, whose ``max_tokens`` bounds that turn alone; the session's end
finishes it. What is refused: a runner's claim, a next turn for an environment episode, a
call asking another top-k, ``session_end`` anywhere else. Stored forms: new versions only for
harness-driven records."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from statemachine import (
    HARNESS_CALL,
    BudgetExceeded,
    EpisodeSpec,
    FinishReason,
    IllegalTransition,
    InvalidRequest,
    NotAnEpisode,
    RolloutState,
    SamplingParams,
    Status,
    TopLogprobsMismatch,
    apply,
    codec,
    fold,
    harness_commands,
)
from statemachine.commands import NewTokens
from tests import factories as f


def _head(record: bytes) -> tuple[str, int]:
    """A stored record's type name and schema version (after the magic byte and the CRC)."""
    name, version, *_ = msgpack.unpackb(record[5:])
    return name, version


def _new(n: int) -> NewTokens:
    return NewTokens(
        token_ids=np.arange(10, 10 + n, dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32),
        weight_versions=np.zeros(n, dtype=np.int64),
    )


def _turn(s: RolloutState, n: int, reason: FinishReason = FinishReason.STOP) -> RolloutState:
    """The live attempt samples ``n`` tokens and its turn ends with ``reason``."""
    for e in harness_commands.end_turn(s, reason, 7 if reason is FinishReason.STOP else None,
                                       tokens=_new(n)):  # fmt: skip
        s = apply(s, e)
    return s


def _feed(s: RolloutState, obs: int, max_tokens: int, batch: str) -> RolloutState:
    event = harness_commands.request_turn(
        s, call_batch=batch, observation_token_ids=np.arange(500, 500 + obs, dtype=np.int32),
        sampling=SamplingParams(max_tokens=max_tokens, min_tokens=2),
    )  # fmt: skip
    s = apply(s, event)
    return apply(s, f.resumed(s))


def _three_turns() -> tuple[RolloutState, list]:
    s = apply(None, f.harness_submitted(max_tokens=4))
    s = apply(s, f.started(s))
    s = _turn(s, 4, FinishReason.LENGTH)  # the first call's 4 tokens, all it asked
    s = _feed(s, 3, max_tokens=6, batch="call-b")
    s = _turn(s, 5)  # 9 sampled in all: beyond the first call's max_tokens, within the turn's
    s = _feed(s, 2, max_tokens=8, batch="call-c")
    s = _turn(s, 1)
    return s, []


def test_three_calls_are_three_turns_of_one_context() -> None:
    s, _ = _three_turns()
    assert s.status is Status.AWAITING_TOOL and s.attempt == 3
    assert [c.name for c in s.calls] == [HARNESS_CALL] * 3
    assert [harness_commands.turn_finish(c) for c in s.calls] == [
        (FinishReason.LENGTH, None), (FinishReason.STOP, 7), (FinishReason.STOP, 7)]  # fmt: skip
    # The context: turn, observation, turn, observation, turn; the mask marks the sampled.
    assert s.loss_mask.tolist() == [1] * 4 + [0] * 3 + [1] * 5 + [0] * 2 + [1]
    assert s.turns == ((0, 4), (7, 12), (14, 15))
    assert [c.result.call_batch for c in s.calls[:2]] == ["call-b", "call-c"]  # type: ignore[union-attr]
    done = apply(s, harness_commands.end_session(s)[0])
    assert done.status is Status.DONE and done.finish_reason is FinishReason.SESSION_END


def test_each_turn_is_bounded_by_its_own_calls_max_tokens() -> None:
    s = apply(None, f.harness_submitted(max_tokens=4))
    s = apply(s, f.started(s))
    s = _turn(s, 2)
    s = _feed(s, 1, max_tokens=3, batch="call-b")
    with pytest.raises(BudgetExceeded):
        apply(s, f.tokens(s, n=4))  # 4 > the turn's 3
    s = apply(s, f.tokens(s, n=2))
    # An abort mid-turn resumes with what the turn has left, min_tokens counted in the turn.
    s = apply(s, f.aborted(s))
    s = apply(s, f.resumed(s))
    sampling = s.resume_sampling()
    assert (sampling.max_tokens, sampling.min_tokens) == (1, 0)
    assert s.remaining_tokens == 1 and s.turn_sampled == 2


def test_what_a_harness_driven_episode_refuses() -> None:
    s = apply(None, f.harness_submitted())
    s = apply(s, f.started(s))
    with pytest.raises(IllegalTransition):  # session_end names a turn's end, not a stop
        apply(s, f.finished(s, FinishReason.SESSION_END))
    s = _turn(s, 2)
    with pytest.raises(NotAnEpisode):  # no runner claims a harness's turn
        apply(s, f.claimed(s))
    with pytest.raises(TopLogprobsMismatch):  # its tokens keep one top-k
        apply(s, f.turn_requested(s, sampling=SamplingParams(max_tokens=4, logprobs=2)))
    with pytest.raises(InvalidRequest):
        EpisodeSpec(harness=True, tool_call_stop_token_ids=(7,))


def test_an_environment_episode_refuses_a_harness_turn_and_session_end() -> None:
    s = apply(None, f.episode_submitted())
    for make in (f.started, f.tokens, f.requested):
        s = apply(s, make(s))
    with pytest.raises(NotAnEpisode):
        apply(s, f.turn_requested(s))
    with pytest.raises(IllegalTransition):
        apply(s, f.budget_finished(s, FinishReason.SESSION_END))
    assert harness_commands.end_session(s) == []


def test_records_round_trip_under_new_versions_only_for_harness_driven_episodes() -> None:
    s = apply(None, f.harness_submitted())
    events = [f.harness_submitted()]
    for make in (f.started, lambda s: f.tokens(s, n=2), lambda s: f.requested(s, "harness"),
                 f.turn_requested, f.resumed):  # fmt: skip
        events.append(make(s))
        s = apply(s, events[-1])
    events.append(f.aborted(s))
    s = apply(s, events[-1])
    # (Tool records are stored lean: read with the rollout id and seq they are stored under.)
    decoded = [codec.decode(codec.encode(e), rollout_id=e.rollout_id, seq=e.seq) for e in events]
    assert decoded == events and fold(decoded) is not None
    assert _head(codec.encode(events[0])) == ("submitted", 6)
    assert codec.encode(events[4])[:1] == codec.LEAN_MAGIC
    end = f.budget_finished(s, FinishReason.SESSION_END)
    assert _head(codec.encode(end)) == ("finished", 3)
    # An environment episode and a plain rollout keep the versions they had.
    assert _head(codec.encode(f.episode_submitted())) == ("submitted", 5)
    assert _head(codec.encode(f.submitted())) == ("submitted", 3)
