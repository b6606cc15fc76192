"""Commands number and fill in events from the state; ``apply`` accepts what they build."""

from __future__ import annotations

import numpy as np
import pytest

from statemachine import (
    Aborted,
    AbortReason,
    Finished,
    FinishReason,
    IllegalTransition,
    Resumed,
    Started,
    TokensAppended,
    apply,
    codec,
    commands,
    fold,
)
from statemachine.commands import NewTokens
from tests import factories as f


def _tokens(n: int, start: int = 100) -> NewTokens:
    return NewTokens(
        token_ids=np.arange(start, start + n, dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32),
        weight_versions=np.zeros(n, dtype=np.int64),
    )


def _apply_all(state, events):  # type: ignore[no-untyped-def]
    for e in events:
        state = apply(state, e)
    return state


def test_a_rollouts_life_built_by_commands_is_legal_and_numbered() -> None:
    s = apply(None, commands.submit("r", f.request(16), queue="qk", at=1.0))
    assert (s.seq, s.queue, s.submitted_at) == (1, "qk", 1.0)
    begin = dict(worker_id="w1", weight_version=0, weight_mode="abort", model="m:1")
    s = _apply_all(s, commands.begin(s, **begin))
    s = apply(s, commands.checkpoint(s, _tokens(4)))
    events = commands.abort(s, AbortReason.WEIGHT_UPDATE, "v0 -> v1", tokens=_tokens(3, 104))
    assert [type(e) for e in events] == [TokensAppended, Aborted]
    assert [e.seq for e in events] == [s.seq + 1, s.seq + 2]
    assert isinstance(events[0], TokensAppended) and events[0].offset == 4
    s = _apply_all(s, events)
    [resumed] = commands.begin(s, **{**begin, "worker_id": "w2"})
    assert isinstance(resumed, Resumed) and resumed.attempt == 2
    s = apply(s, resumed)
    s = _apply_all(s, commands.finish(s, FinishReason.LENGTH, tokens=_tokens(9, 107)))
    assert s.terminal and s.num_tokens == 16
    assert s.token_ids.tolist() == list(range(100, 116))


def test_begin_on_a_live_rollout_takes_it_over_first() -> None:
    s = apply(None, commands.submit("r", f.request(8)))
    s = _apply_all(s, commands.begin(s, worker_id="dead", weight_version=0,
                                     weight_mode="abort", model=""))  # fmt: skip
    events = commands.begin(s, worker_id="w2", weight_version=0, weight_mode="abort", model="")
    assert [type(e) for e in events] == [Aborted, Resumed]
    assert events[0].reason is AbortReason.WORKER_LOST and "taken over by w2" in events[0].detail
    assert _apply_all(s, events).attempt == 2
    first = commands.begin(apply(None, commands.submit("n", f.request(8))), worker_id="w",
                           weight_version=0, weight_mode="abort", model="")  # fmt: skip
    assert [type(e) for e in first] == [Started]


def test_a_finish_without_new_tokens_is_one_event_and_illegal_commands_are_refused() -> None:
    s = apply(None, commands.submit("r", f.request(8)))
    with pytest.raises(IllegalTransition):
        apply(s, commands.finish(s, FinishReason.STOP)[0])  # pending: nothing to finish
    s = _apply_all(s, commands.begin(s, worker_id="w", weight_version=0, weight_mode="abort",
                                     model=""))  # fmt: skip
    assert [type(e) for e in commands.finish(s, FinishReason.STOP, tokens=None)] == [Finished]
    s = apply(s, commands.cancel(s, "not needed"))
    with pytest.raises(IllegalTransition):
        apply(s, commands.fail(s, "too late"))


def test_an_engine_death_recorded_by_old_code_reads_as_engine_dead() -> None:
    from tests.statemachine.test_codec import _forge

    old = _forge(["aborted", 1, "r", 3, 0.0, {"attempt": 1, "reason": "engine_error",
                                              "detail": "EngineDead: core exited"}])  # fmt: skip
    event = codec.decode(old)
    assert isinstance(event, Aborted) and event.reason is AbortReason.ENGINE_DEAD
    own = _forge(["aborted", 1, "r", 3, 0.0, {"attempt": 1, "reason": "engine_error",
                                              "detail": "EngineError: bad prompt"}])  # fmt: skip
    assert codec.decode(own).reason is AbortReason.ENGINE_ERROR  # type: ignore[attr-defined]
    assert fold([]) is None
