"""store.timeline: a rollout's events read as an operator's timeline (pure: no Redis)."""

from __future__ import annotations

import numpy as np
import pytest

from statemachine import (
    AbortReason,
    Event,
    FailureClass,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    apply,
    commands,
)
from statemachine.commands import NewTokens
from store.timeline import build


class Log:
    """Events as a worker and a trainer would write them, checked by the domain on the way."""

    def __init__(self) -> None:
        request = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=64))
        first = commands.submit("r", request, admitted_version=3, queue="q")
        self.events: list[Event] = [first]
        self.state: RolloutState = apply(None, first)

    def add(self, *events: Event) -> None:
        for e in events:
            self.state = apply(self.state, e)
            self.events.append(e)

    def begin(self, worker: str, version: int) -> None:
        self.add(*commands.begin(self.state, worker_id=worker, weight_version=version,
                                 weight_mode="keep", model="m"))  # fmt: skip

    def tokens(self, *versions: int) -> None:
        n = len(versions)
        self.add(commands.checkpoint(self.state, NewTokens(
            token_ids=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
            weight_versions=np.array(versions, np.int64),
        )))  # fmt: skip


def test_chunks_are_summarized_per_attempt_with_tokens_per_weight_version() -> None:
    log = Log()
    log.begin("w1", 3)
    log.tokens(3, 3)
    log.tokens(3, 4, 4)  # weights changed mid-attempt (keep mode)
    log.add(*commands.abort(log.state, AbortReason.WEIGHT_UPDATE, "v5 published"))
    log.begin("w2", 5)
    log.tokens(5)
    log.add(commands.cancel(log.state, "take=4 reached"))
    t = build(log.events)
    assert [e.kind for e in t.entries] == [
        "submitted", "started", "checkpoints", "aborted", "resumed", "checkpoints", "cancelled",
    ]  # fmt: skip
    _, started, ck1, aborted, resumed, ck2, cancelled = t.entries
    assert (started.worker_id, started.weight_version, started.attempt) == ("w1", 3, 1)
    assert (ck1.tokens, ck1.checkpoints, ck1.by_version) == (5, 2, {3: 3, 4: 2})
    assert ck1.until == log.events[3].at
    assert (aborted.reason, aborted.detail, aborted.tokens) == ("weight_update", "v5 published", 5)
    assert (resumed.worker_id, resumed.tokens, resumed.attempt) == ("w2", 5, 2)
    assert (ck2.tokens, ck2.by_version) == (1, {5: 1})
    assert (cancelled.detail, cancelled.tokens) == ("take=4 reached", 6)
    assert t.by_version == {3: 3, 4: 2, 5: 1}
    assert (t.prompt_tokens, t.max_tokens, t.queue, t.admitted_version) == (3, 64, "q", 3)
    assert t.state.status.value == "cancelled"
    d = t.to_dict()
    assert d["tokens_by_weight_version"] == {"3": 3, "4": 2, "5": 1}
    assert d["entries"][2] == {
        "kind": "checkpoints", "seq": 3, "at": ck1.at, "until": ck1.until, "attempt": 1,
        "tokens": 5, "checkpoints": 2, "by_version": {"3": 3, "4": 2},
    }  # fmt: skip


def test_a_takeover_then_a_failure() -> None:
    log = Log()
    log.begin("w1", 0)
    log.tokens(0, 0)
    log.begin("w2", 0)  # w1's lease lapsed: aborted(worker_lost) then resumed, one chain
    log.add(commands.fail(log.state, "CUDA error", FailureClass.ENGINE_ERROR))
    kinds = [(e.kind, e.attempt, e.reason) for e in build(log.events).entries]
    assert kinds == [
        ("submitted", None, ""), ("started", 1, ""), ("checkpoints", 1, ""),
        ("aborted", 1, "worker_lost"), ("resumed", 2, ""), ("failed", 2, "engine_error"),
    ]  # fmt: skip
    failed = build(log.events).entries[-1]
    assert (failed.detail, failed.tokens) == ("CUDA error", 2)


def test_a_log_without_its_submitted_record_is_refused() -> None:
    with pytest.raises(ValueError, match="Submitted first"):
        build([])
