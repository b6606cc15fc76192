"""Observation routes (``TokensAppended.observation_routes``): recorded on the first chunk of the
turn after a tool result only, once, one row per observation token; stored as tokens_appended
v3 while every other chunk keeps its bytes; and laid out by ``RolloutState.context_routes``
aligned with the context, with a presence mask."""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest

from statemachine import (
    CorruptRecord,
    Event,
    InvalidEvent,
    RolloutState,
    RoutesMismatch,
    TokensAppended,
    UnsupportedSchema,
    apply,
    codec,
)
from tests import factories as f


def run(s: RolloutState | None, *events: Event) -> RolloutState:
    for event in events:
        s = apply(s, event)
    assert s is not None
    return s


def next_turn(obs: int = 3, routes: bool = True) -> RolloutState:
    """An episode whose first turn (4 tokens) called a tool that answered ``obs`` tokens; its
    second turn has begun and has no token yet."""
    s = run(None, f.episode_submitted())
    s = run(s, f.started(s))
    s = run(s, f.tokens(s, routes=routes))
    s = run(s, f.requested(s))
    s = run(s, f.claimed(s))
    s = run(s, f.result(s, n=obs))
    return run(s, f.resumed(s))


def _body(record: bytes) -> list:
    return msgpack.unpackb(record[5:], raw=False)


# -- the event and its stored form --------------------------------------------------------------


def test_a_chunk_with_observation_routes_round_trips_as_v3() -> None:
    s = next_turn()
    event = f.tokens(s, routes=True, observed=3)
    record = codec.encode(event)
    name, version, *_, fields = _body(record)
    assert (name, version) == ("tokens_appended", 3)
    assert fields["observation_routes"][:2] == ["|u1", [3, 2, 2]]
    # v3 spells the top-k keys out (null): it is never upcast through v1, which adds them.
    assert fields["top_token_ids"] is None and fields["top_logprobs"] is None
    back = codec.decode(record)
    assert back == event
    assert isinstance(back, TokensAppended) and back.observation_routes is not None
    np.testing.assert_array_equal(back.observation_routes, event.observation_routes)  # type: ignore[arg-type]
    # With top-k arrays too.
    event = TokensAppended(
        **{**_args(f.tokens(s, routes=True, observed=3)), "top_token_ids": [[1]] * 4,
           "top_logprobs": [[-0.5]] * 4},
    )  # fmt: skip
    assert codec.decode(codec.encode(event)) == event


def _args(e: TokensAppended) -> dict:
    names = ("rollout_id", "seq", "at", "attempt", "offset", "token_ids", "logprobs",
             "weight_versions", "routed_experts", "nonfinite_logprobs", "top_token_ids",
             "top_logprobs", "observation_routes")  # fmt: skip
    return {n: getattr(e, n) for n in names}


def test_chunks_without_them_keep_their_v1_and_v2_bytes() -> None:
    """Plain chunks (and top-k ones) are stored exactly as before observation routes existed:
    no new key, the old version, so the hot path writes the same bytes."""
    s = next_turn()
    plain = f.tokens(s, routes=True)
    _, version, *_, fields = _body(codec.encode(plain))
    assert version == 1 and "observation_routes" not in fields and "top_token_ids" not in fields
    top = TokensAppended(
        **{**_args(plain), "top_token_ids": [[1]] * 4, "top_logprobs": [[0.0]] * 4}
    )
    _, version, *_, fields = _body(codec.encode(top))
    assert version == 2 and "observation_routes" not in fields
    # Old records decode with none (v1 -> v2 -> v3, v2 -> v3).
    for event in (plain, top):
        back = codec.decode(codec.encode(event))
        assert isinstance(back, TokensAppended) and back.observation_routes is None


def test_a_v3_record_is_refused_by_code_that_predates_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older reader (current version 2) refuses a v3 chunk as newer instead of reading it
    without its routes."""
    record = codec.encode(f.tokens(next_turn(), routes=True, observed=3))
    entry = codec.REGISTRY["tokens_appended"]
    monkeypatch.setitem(codec.REGISTRY, "tokens_appended", (entry[0], 2, *entry[2:]))
    with pytest.raises(UnsupportedSchema, match="v3 is newer"):
        codec.decode(record)


def test_a_v3_record_missing_its_routes_is_corrupt() -> None:
    record = codec.encode(f.tokens(next_turn(), routes=True, observed=3))
    body = _body(record)
    del body[5]["observation_routes"]
    packed = msgpack.packb(body, use_bin_type=True)
    forged = b"R" + zlib.crc32(packed).to_bytes(4, "little") + packed
    with pytest.raises(CorruptRecord, match="bad tokens_appended fields"):
        codec.decode(forged)


@pytest.mark.parametrize(
    ("routes", "observed", "match"),
    [
        (None, np.zeros((0, 2, 2), np.uint8), "needs a row"),
        (None, np.zeros((3, 2), np.uint8), r"\[tokens, layers, top_k\]"),
        (None, -np.ones((3, 2, 2), np.int64), "negative"),
        (np.zeros((4, 2, 2), np.uint8), np.zeros((3, 3, 2), np.uint8), "one model"),
    ],
)
def test_malformed_observation_routes_are_refused(
    routes: np.ndarray | None, observed: np.ndarray, match: str
) -> None:
    args = {**_args(f.tokens(next_turn())), "routed_experts": routes}
    with pytest.raises(InvalidEvent, match=match):
        TokensAppended(**{**args, "observation_routes": observed})


# -- transitions -------------------------------------------------------------------------------


def test_the_first_chunk_after_a_result_records_them_once() -> None:
    s = next_turn()
    s = run(s, f.tokens(s, routes=True, observed=3))
    # Later chunks of the turn (an attempt resumed mid-turn, or the next checkpoint) cannot.
    before = s
    with pytest.raises(RoutesMismatch, match="does not begin a turn"):
        apply(s, f.tokens(s, routes=True, observed=3))
    s = run(s, f.aborted(s))
    s = run(s, f.resumed(s))
    with pytest.raises(RoutesMismatch, match="does not begin a turn"):
        apply(s, f.tokens(s, routes=True, observed=3))
    assert before.num_tokens == s.num_tokens  # nothing was applied


@pytest.mark.parametrize("observed", [2, 4])
def test_one_row_per_observation_token(observed: int) -> None:
    s = next_turn(obs=3)
    with pytest.raises(RoutesMismatch, match=f"{observed} observation-route rows .* 3 tokens"):
        apply(s, f.tokens(s, routes=True, observed=observed))


def test_not_on_a_first_turn_nor_a_plain_rollout() -> None:
    plain = run(None, f.submitted(max_tokens=64))
    plain = run(plain, f.started(plain))
    first = run(None, f.episode_submitted())
    first = run(first, f.started(first))
    for s in (plain, first):
        with pytest.raises(RoutesMismatch):
            apply(s, f.tokens(s, routes=True, observed=3))


def test_an_attempt_that_saved_no_token_leaves_them_to_the_next() -> None:
    """A turn's attempt aborted before its first checkpoint: the next attempt's first chunk
    is still the turn's first, and records them."""
    s = next_turn()
    s = run(s, f.aborted(s))
    s = run(s, f.resumed(s))
    s = run(s, f.tokens(s, routes=True, observed=3))
    assert s.chunks[-1].observation_routes is not None


# -- the context's routes ------------------------------------------------------------------------


def test_context_routes_align_with_the_context_with_a_presence_mask() -> None:
    s = next_turn(obs=3)
    second = f.tokens(s, routes=True, observed=3)
    s = run(s, second)  # turn 2: 4 tokens after the 3-token observation
    s = run(s, f.requested(s))
    s = run(s, f.claimed(s))
    s = run(s, f.result(s, n=2))
    s = run(s, f.resumed(s))
    s = run(s, f.tokens(s, routes=True))  # turn 3: no observation routes (an engine without)
    routes, present = s.context_routes()
    assert routes is not None and present is not None
    assert len(routes) == len(present) == len(s.context_token_ids) == 4 + 3 + 4 + 2 + 4
    assert present.tolist() == [True] * 11 + [False] * 2 + [True] * 4
    np.testing.assert_array_equal(routes[4:7], second.observation_routes)  # type: ignore[arg-type]
    np.testing.assert_array_equal(routes[7:11], second.routed_experts)  # type: ignore[arg-type]
    assert not routes[11:13].any()  # absent rows are zero
    # Sampled rows are those of the state's own concatenation, in context order.
    sampled = s.sampled_positions
    np.testing.assert_array_equal(routes[sampled], s.routed_experts)  # type: ignore[arg-type]


def test_a_dense_model_has_no_context_routes_and_a_plain_rollout_its_own() -> None:
    assert next_turn(routes=False).context_routes() == (None, None)
    s = run(None, f.submitted(max_tokens=64))
    s = run(s, f.started(s))
    s = run(s, f.tokens(s, routes=True))
    routes, present = s.context_routes()
    assert present is not None and present.all()
    np.testing.assert_array_equal(routes, s.routed_experts)  # type: ignore[arg-type]
