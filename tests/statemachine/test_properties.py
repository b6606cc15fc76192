"""Hypothesis properties: any sequence of events, legal or not, folds consistently."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statemachine import (
    TRANSITIONS,
    Aborted,
    AbortReason,
    Cancelled,
    Event,
    Failed,
    Finished,
    FinishReason,
    Resumed,
    RolloutState,
    Started,
    Status,
    Submitted,
    TokensAppended,
    TransitionError,
    apply,
    codec,
    fold,
)
from tests import factories as f

# Weighted so that long, interesting histories are common: terminal events are rare.
KINDS = (
    ["tokens"] * 10
    + ["started", "resumed"] * 3
    + ["aborted"] * 3
    + ["submitted", "finished", "failed", "cancelled"]
)


_TYPE_OF = {
    "submitted": Submitted,
    "started": Started,
    "resumed": Resumed,
    "tokens": TokensAppended,
    "aborted": Aborted,
    "finished": Finished,
    "failed": Failed,
    "cancelled": Cancelled,
}


@st.composite
def candidate(draw: st.DrawFn, state: RolloutState | None) -> Event:
    """An event aimed at ``state``: usually plausible, sometimes off by a seq, an attempt, an
    offset or a budget, sometimes of a type the state does not allow."""
    legal = [k for k in KINDS if (state and state.status, _TYPE_OF[k]) in TRANSITIONS]
    # Mostly a type the state allows (so histories grow long), sometimes any type at all.
    kind = draw(st.sampled_from(legal if legal and draw(st.integers(0, 4)) else KINDS))
    base = state
    if kind == "submitted" or base is None:
        e: Event = f.submitted(max_tokens=draw(st.integers(1, 40)))
        return dataclasses.replace(e, seq=draw(st.sampled_from([1, 1, 1, 2])))
    seq = base.seq + 1 + draw(st.sampled_from([0, 0, 0, 0, 0, 1, -1]))
    attempt_shift = draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    if kind in ("started", "resumed"):
        maker = f.started if kind == "started" else f.resumed
        e = maker(base, version=draw(st.integers(0, 3)))
        return dataclasses.replace(e, seq=seq, attempt=max(0, e.attempt + attempt_shift))  # type: ignore[call-arg]
    if kind == "tokens":
        n = draw(st.integers(1, 6))
        return f.tokens(
            base,
            n=n,
            seq=seq,
            attempt=max(0, base.attempt + attempt_shift),
            offset=max(0, base.num_tokens + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))),
            version=draw(st.integers(0, 3)),
            routes=draw(st.booleans()),
        )
    if kind == "aborted":
        e = f.aborted(
            base,
            draw(st.sampled_from(list(AbortReason))),
            attempt=max(0, base.attempt + attempt_shift),
        )
    elif kind == "finished":
        e = dataclasses.replace(
            f.finished(base, draw(st.sampled_from(list(FinishReason)))),
            attempt=max(0, base.attempt + attempt_shift),
        )
    elif kind == "failed":
        e = f.failed(base)
    else:
        e = f.cancelled(base)
    return dataclasses.replace(e, seq=seq)


def check_invariants(s: RolloutState) -> None:
    assert s.num_tokens == sum(len(c) for c in s.chunks) == s.token_ids.shape[0]
    assert s.num_tokens <= s.request.sampling.max_tokens
    assert [c.offset for c in s.chunks] == list(np.cumsum([0] + [len(c) for c in s.chunks])[:-1])
    assert s.logprobs.shape == s.weight_versions.shape == s.token_ids.shape
    if s.routed_experts is not None:
        assert s.routed_experts.shape[0] == sum(
            len(c) for c in s.chunks if c.routed_experts is not None
        )
    assert s.live_attempt == (s.attempt if s.status in (Status.GENERATING, Status.RESUMED) else 0)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_event_sequence_folds_consistently(data: st.DataObject) -> None:
    state: RolloutState | None = None
    accepted: list[Event] = []
    for _ in range(data.draw(st.integers(1, 30))):
        event = data.draw(candidate(state))
        before = None if state is None else codec.encode_snapshot(state)
        try:
            state = apply(state, event)
        except TransitionError:
            # Refused: the state object is untouched (same object, same stored form).
            assert (None if state is None else codec.encode_snapshot(state)) == before
            continue
        accepted.append(event)
        check_invariants(state)
        if state.terminal:
            assert event is accepted[-1]
    # The accepted prefix alone rebuilds exactly the same state ...
    assert fold(accepted) == state
    if state is not None:
        # ... and so does the stored form: events and snapshot through the codec.
        decoded = [codec.decode(codec.encode(e)) for e in accepted]
        assert decoded == accepted
        chunks = tuple(e for e in decoded if isinstance(e, TokensAppended))
        sub = decoded[0]
        assert isinstance(sub, Submitted)
        assert codec.decode_snapshot(codec.encode_snapshot(state), sub, chunks) == state
