"""The stored form: exact round trips, and damaged bytes always refused, never mis-decoded."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from statemachine import (
    DEFAULT_QUEUE,
    Aborted,
    AbortReason,
    CodecError,
    CorruptRecord,
    Event,
    Failed,
    FailureClass,
    FinishReason,
    GroupPolicy,
    InvalidEvent,
    Membership,
    Started,
    Submitted,
    TokensAppended,
    UnknownEventType,
    UnsupportedSchema,
    apply,
    codec,
)
from statemachine.arrays import pack_array, unpack_array
from statemachine.episode_events import TOOL_EVENTS
from tests import factories as f

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=40)


@st.composite
def token_events(draw: st.DrawFn) -> TokensAppended:
    n = draw(st.integers(1, 64))
    experts = draw(st.sampled_from([2, 8, 128, 255, 256, 300, 65535, 65536, 100_000]))
    routes = draw(
        st.none()
        | hnp.arrays(
            np.int64,
            (n, draw(st.integers(1, 4)), draw(st.integers(1, 8))),
            elements=st.integers(0, experts - 1),
        )
    )
    # Observation routes (a turn's first chunk): rows shaped as the chunk's routes.
    shape = (1, 2) if routes is None else routes.shape[1:]
    observed = draw(
        st.none()
        | hnp.arrays(
            np.int64, (draw(st.integers(1, 9)), *shape), elements=st.integers(0, experts - 1)
        )
    )
    width = draw(st.integers(0, 20))
    top = None
    if width:
        top = (
            draw(hnp.arrays(np.int32, (n, width), elements=st.integers(0, 2**31 - 1))),
            draw(hnp.arrays(np.float32, (n, width), elements=st.floats(width=32))),
        )
    return TokensAppended(
        rollout_id=draw(ids),
        seq=draw(st.integers(1, 2**40)),
        attempt=draw(st.integers(1, 99)),
        offset=draw(st.integers(0, 2**31)),
        at=draw(st.floats(0, 4e9, allow_nan=False)),
        token_ids=draw(hnp.arrays(np.int32, n, elements=st.integers(0, 2**31 - 1))),
        # Any float32 bit pattern, NaN and infinities included: the codec stores, never judges.
        logprobs=draw(hnp.arrays(np.float32, n, elements=st.floats(width=32))),
        weight_versions=draw(hnp.arrays(np.int64, n, elements=st.integers(0, 2**62))),
        routed_experts=routes,
        top_token_ids=None if top is None else top[0],
        top_logprobs=None if top is None else top[1],
        observation_routes=observed,
    )


def other_events() -> st.SearchStrategy[Event]:
    s = f.submitted()
    from statemachine import apply

    st0 = apply(None, s)
    st1 = apply(st0, f.started(st0))
    return st.sampled_from(
        [
            s,
            f.started(st0),
            f.tokens(st1, routes=True),
            f.aborted(st1, AbortReason.SHUTDOWN),
            f.finished(st1),
            f.failed(st1, "CUDA out of memory: ünïcode ok"),
            f.cancelled(st1),
            f.resumed(apply(st1, f.aborted(st1))),
            f.submitted(max_tokens=5, stop=("</s>",), stop_token_ids=(2,), seed=7, temperature=0.0),
            *_episode_events(),
        ]
    )


def _episode_events() -> list[Event]:
    """One of each episode event (and an episode's Submitted), through legal states."""
    sub = f.episode_submitted(max_turns=3, max_wall_seconds=60.0, max_tool_seconds=5)
    s = apply(None, sub)
    s = apply(s, f.started(s))
    s = apply(s, f.tokens(s))
    out: list[Event] = [sub]
    for make in (f.requested, f.claimed, f.call_failed, f.claimed, f.call_lost, f.claimed):
        event = make(s)
        out.append(event)
        s = apply(s, event)
    out.append(f.result(s, n=5))
    out.append(f.budget_finished(s, FinishReason.TOOL_TIME))
    out.append(Failed(rollout_id="r1", seq=9, error="x", attempts=1,
                      failure=FailureClass.EFFECT_UNVERIFIED))  # fmt: skip
    return out


events = token_events() | other_events()


@settings(max_examples=200)
@given(events)
def test_round_trip_is_exact(event: Event) -> None:
    record = codec.encode(event)
    assert codec.decode(record, rollout_id=event.rollout_id, seq=event.seq) == event
    if not isinstance(event, TOOL_EVENTS):
        # Every record but a lean one also says where it belongs (a lean one needs to be told:
        # tests/statemachine/test_episode_codec.py).
        assert codec.decode(record) == event


@given(token_events())
def test_routes_use_smallest_dtype_and_raw_bytes(event: TokensAppended) -> None:
    if event.routed_experts is not None:
        top = int(event.routed_experts.max()) if event.routed_experts.size else 0
        expect = np.uint8 if top < 256 else np.uint16 if top < 65536 else np.uint32
        assert event.routed_experts.dtype == expect
    body = msgpack.unpackb(codec.encode(event)[5:], raw=False)
    fields = body[5]
    # Arrays are [dtype, shape, bytes], not nested lists of numbers.
    assert isinstance(fields["token_ids"][2], bytes)
    assert len(fields["token_ids"][2]) == 4 * len(event)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=">i4"),  # big-endian: stored little-endian
        np.arange(24, dtype="<i4")[::2],  # strided view: stored contiguous
        np.arange(2 * 3 * 4, dtype="u1").reshape(4, 3, 2).transpose(2, 1, 0),  # Fortran order
        np.arange(6, dtype="<f4").reshape(2, 3),
    ],
)
def test_any_array_layout_packs_to_the_same_values(arr: np.ndarray) -> None:
    # pack_array has a fast path for the C-contiguous little-endian arrays events hold; every
    # other layout must still store the values, not its raw memory.
    packed = msgpack.unpackb(msgpack.packb(pack_array(arr), use_bin_type=True), raw=False)
    out = unpack_array(packed)
    assert out.dtype.byteorder in "<|=" and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@settings(max_examples=400)
@given(events, st.data())
def test_any_damage_is_refused(event: Event, data: st.DataObject) -> None:
    record = bytearray(codec.encode(event))
    how = data.draw(st.sampled_from(["flip", "truncate", "insert", "append", "delete"]))
    pos = data.draw(st.integers(0, len(record) - 1))
    if how == "flip":
        record[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del record[pos:]
    elif how == "insert":
        record.insert(pos, data.draw(st.integers(0, 255)))
    elif how == "append":
        record += data.draw(st.binary(min_size=1, max_size=8))
    else:
        del record[pos]
    with pytest.raises(CodecError):
        codec.decode(bytes(record), rollout_id=event.rollout_id, seq=event.seq)


def test_errors_name_the_rollout_and_sequence() -> None:
    record = bytearray(codec.encode(f.submitted("my-rollout")))
    record[-1] ^= 1
    with pytest.raises(CorruptRecord, match=r"rollout 'my-rollout' event #1: checksum"):
        codec.decode(bytes(record), rollout_id="my-rollout", seq=1)
    with pytest.raises(CorruptRecord, match="record says rollout 'my-rollout' event #1"):
        codec.decode(codec.encode(f.submitted("my-rollout")), rollout_id="other", seq=1)


def _forge(body: list) -> bytes:
    """A record with a valid checksum around an arbitrary body: what a buggy writer makes."""
    import zlib

    packed = msgpack.packb(body, use_bin_type=True)
    return b"R" + zlib.crc32(packed).to_bytes(4, "little") + packed


def test_unknown_type_and_future_schema_are_named() -> None:
    with pytest.raises(
        UnknownEventType, match="rollout 'r' event #3: unknown event type 'teleported'"
    ):
        codec.decode(_forge(["teleported", 1, "r", 3, 0.0, {}]))
    with pytest.raises(UnsupportedSchema, match="v9 is newer"):
        codec.decode(_forge(["cancelled", 9, "r", 3, 0.0, {"reason": ""}]))
    with pytest.raises(CorruptRecord, match="bad aborted fields"):
        codec.decode(_forge(["aborted", 1, "r", 3, 0.0, {"attempt": 1, "reason": "meteor"}]))
    with pytest.raises(CorruptRecord, match="needs 12 bytes, got 8"):
        codec.decode(_forged_tokens(["<i4", [3], b"\x00" * 8], n=3))  # 2 ids' bytes for 3
    with pytest.raises(CorruptRecord, match="not allowed"):
        codec.decode(_forged_tokens(["|O", [1], b"\x00" * 8], n=1))  # object dtype: never


def _forged_tokens(token_ids: list, n: int) -> bytes:
    """A checksummed tokens_appended record whose token_ids field is ``token_ids``."""
    fields = {
        "attempt": 1,
        "offset": 0,
        "token_ids": token_ids,
        "logprobs": ["<f4", [n], b"\x00" * 4 * n],
        "weight_versions": ["<i8", [n], b"\x00" * 8 * n],
        "routed_experts": None,
        "nonfinite_logprobs": 0,
    }
    return _forge(["tokens_appended", 1, "r", 3, 0.0, fields])


def _v1_tokens_record(n: int) -> bytes:
    """A tokens_appended record exactly as the code before top-k logprobs wrote it."""
    fields = {
        "attempt": 1,
        "offset": 0,
        "token_ids": ["<i4", [n], np.arange(n, dtype="<i4").tobytes()],
        "logprobs": ["<f4", [n], np.full(n, -0.5, dtype="<f4").tobytes()],
        "weight_versions": ["<i8", [n], b"\x00" * 8 * n],
        "routed_experts": None,
        "nonfinite_logprobs": 0,
    }
    return _forge(["tokens_appended", 1, "r", 3, 0.0, fields])


def test_a_chunk_without_top_logprobs_is_stored_as_before_and_old_records_decode() -> None:
    old = _v1_tokens_record(3)
    event = codec.decode(old)
    assert isinstance(event, TokensAppended)
    assert event.top_token_ids is None and event.top_logprobs is None and event.top_k == 0
    np.testing.assert_array_equal(event.token_ids, [0, 1, 2])
    # Re-encoded: the very same bytes (v1, no new keys), so k=0 rollouts cost nothing more.
    assert codec.encode(event) == old


def test_top_logprobs_round_trip_as_v2_packed_arrays() -> None:
    ids = np.array([[5, 7], [1, 2], [9, 3]], dtype=np.int32)
    lps = np.array([[-0.1, -2.5], [-0.3, -1.5], [-0.01, -6.0]], dtype=np.float32)
    old = codec.decode(_v1_tokens_record(3))
    assert isinstance(old, TokensAppended)
    event = TokensAppended(
        rollout_id="r", seq=3, at=0.0, attempt=1, offset=0, token_ids=old.token_ids,
        logprobs=old.logprobs, weight_versions=old.weight_versions,
        top_token_ids=ids, top_logprobs=lps,
    )  # fmt: skip
    record = codec.encode(event)
    body = msgpack.unpackb(record[5:], raw=False)
    assert body[1] == 2
    assert body[5]["top_token_ids"] == ["<i4", [3, 2], ids.tobytes()]
    assert body[5]["top_logprobs"] == ["<f4", [3, 2], lps.tobytes()]
    back = codec.decode(record)
    assert back == event and back.top_k == 2
    np.testing.assert_array_equal(back.top_token_ids, ids)
    # A v2 record missing a top array, or one whose shape does not match, is refused.
    for name, value in [
        ("top_logprobs", None),
        ("top_logprobs", ["<f4", [2, 2], lps[:2].tobytes()]),
    ]:
        broken = {**body[5], name: value}
        with pytest.raises(CorruptRecord, match="bad tokens_appended fields"):
            codec.decode(_forge(["tokens_appended", 2, "r", 3, 0.0, broken]))


def test_old_schema_is_upcast_by_a_named_function(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend "aborted" is at v2, whose v1 lacked ``detail``; v1 records must still load.
    name, (cls, _, to_f, from_f) = "aborted", codec.REGISTRY["aborted"]
    monkeypatch.setitem(codec.REGISTRY, name, (cls, 2, to_f, from_f))

    def aborted_v1_to_v2(fields: dict) -> dict:
        return {**fields, "detail": "(recorded before v2)"}

    monkeypatch.setitem(codec.UPCASTERS, ("aborted", 1), aborted_v1_to_v2)
    old = _forge(["aborted", 1, "r", 4, 0.0, {"attempt": 1, "reason": "shutdown"}])
    event = codec.decode(old)
    assert isinstance(event, Aborted) and event.detail == "(recorded before v2)"
    monkeypatch.delitem(codec.UPCASTERS, ("aborted", 1))
    with pytest.raises(UnsupportedSchema, match="no upcaster"):
        codec.decode(old)


def test_no_pickle_anywhere() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg in ("statemachine", "store", "workers"):
        for path in (root / pkg).rglob("*.py"):
            text = path.read_text()
            assert "import pickle" not in text and "cPickle" not in text, path


def test_v1_records_load_with_the_queue_and_model_they_could_not_record() -> None:
    # Records written before the queue and the model were recorded (issue 11) still load.
    request = f.request().to_dict()
    sub = codec.decode(_forge(["submitted", 1, "r", 1, 0.0, {"request": request,
                                                             "admitted_version": 0}]))  # fmt: skip
    assert isinstance(sub, Submitted) and sub.queue == DEFAULT_QUEUE
    start = codec.decode(
        _forge(["started", 1, "r", 2, 0.0,
                {"attempt": 1, "worker_id": "w", "weight_version": 0, "weight_mode": "abort"}])
    )  # fmt: skip
    assert isinstance(start, Started) and start.model == ""
    # A v1 snapshot head (13 fields, no model) decodes with the model unknown.
    first = apply(None, f.submitted("r"))
    state = apply(first, f.started(first))
    v3 = msgpack.unpackb(codec.encode_snapshot(state)[5:])
    assert v3[0] == 3 and len(v3) == 15  # v4 is only for a paused abort (below)
    import zlib

    body = msgpack.packb([1, *v3[1:13]], use_bin_type=True)
    v1 = b"S" + zlib.crc32(body).to_bytes(4, "little") + body
    old = codec.decode_snapshot(v1, f.submitted("r"))
    assert old.model == "" and old.seq == state.seq and old.status == state.status


def test_queue_and_model_round_trip() -> None:
    sub = Submitted(rollout_id="r", seq=1, request=f.request(), queue="qk")
    assert codec.decode(codec.encode(sub)) == sub
    state = apply(None, sub)
    begin = Started(rollout_id="r", seq=2, attempt=1, worker_id="w", weight_version=0,
                    model="qwen3:abc")  # fmt: skip
    assert codec.decode(codec.encode(begin)) == begin
    state = apply(state, begin)
    back = codec.decode_snapshot(codec.encode_snapshot(state), sub)
    assert (back.queue, back.model) == ("qk", "qwen3:abc")


def _forge_snapshot(fields: list[object]) -> bytes:
    import zlib

    body = msgpack.packb(fields, use_bin_type=True)
    return b"S" + zlib.crc32(body).to_bytes(4, "little") + body


def test_v2_records_load_without_a_batch_and_with_a_failure_class() -> None:
    # Records written before batches and failure classes (issue 13) still load: the rollout
    # belongs to no batch, is a group of one, and its failure class is inferred from its error.
    request = f.request().to_dict()
    fields = {"request": request, "admitted_version": 0, "queue": "q"}
    sub = codec.decode(_forge(["submitted", 2, "r", 1, 0.0, fields]))
    assert isinstance(sub, Submitted) and sub.membership == Membership()
    assert sub.membership.batch_id == "" and sub.membership.group_size == 1
    for error, failure in (("unreadable record: crc", FailureClass.UNREADABLE),
                           ("boom", FailureClass.ENGINE_ERROR)):  # fmt: skip
        old = codec.decode(_forge(["failed", 1, "r", 3, 0.0, {"error": error, "attempts": 3}]))
        assert isinstance(old, Failed) and old.failure is failure
    state = apply(None, sub)
    state = apply(state, Failed(rollout_id="r", seq=2, error="unreadable record: x", attempts=0,
                                failure=FailureClass.UNREADABLE))  # fmt: skip
    v3 = msgpack.unpackb(codec.encode_snapshot(state)[5:])
    v2 = _forge_snapshot([2, *v3[1:14]])
    assert codec.decode_snapshot(v2, sub).failure is FailureClass.UNREADABLE


def test_membership_and_failure_round_trip() -> None:
    m = Membership(batch_id="b", group_index=3, sample_index=1, group_size=4,
                   group_policy=GroupPolicy.GROUP)  # fmt: skip
    sub = Submitted(rollout_id="b.3.1", seq=1, request=f.request(), membership=m)
    assert codec.decode(codec.encode(sub)) == sub
    state = apply(None, sub)
    failed = Failed(rollout_id="b.3.1", seq=2, error="prompt too long", attempts=0,
                    failure=FailureClass.REQUEST_ERROR)  # fmt: skip
    assert codec.decode(codec.encode(failed)) == failed
    state = apply(state, failed)
    back = codec.decode_snapshot(codec.encode_snapshot(state), sub)
    assert back.membership == m and back.failure is FailureClass.REQUEST_ERROR


@pytest.mark.parametrize(
    "kwargs",
    [
        {"group_size": 0},
        {"sample_index": 4, "group_size": 4},
        {"group_index": -1},
        {"batch_id": 5},
        {"group_policy": "all"},
    ],
)
def test_impossible_membership_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises((InvalidEvent, ValueError)):
        Membership(**kwargs)  # type: ignore[arg-type]


def test_a_paused_abort_is_its_own_schema_so_older_readers_refuse_it_as_newer() -> None:
    # AbortReason.PAUSED is newer than aborted v2: written as v3 (and its snapshot head as v4),
    # so code that predates it leaves the rollout to a newer worker (UnsupportedSchema)
    # instead of failing it as corrupt. Every other abort is written exactly as before.
    from statemachine import apply

    first = apply(None, f.submitted("r"))
    live = apply(first, f.started(first))
    paused = f.aborted(live, AbortReason.PAUSED)
    record = codec.encode(paused)
    assert msgpack.unpackb(record[5:])[:2] == ["aborted", 3]
    assert codec.decode(record) == paused
    shutdown = codec.encode(f.aborted(live, AbortReason.SHUTDOWN))
    assert msgpack.unpackb(shutdown[5:])[:2] == ["aborted", 2]
    after = apply(live, paused)
    head = codec.encode_snapshot(after)
    assert msgpack.unpackb(head[5:])[0] == 4
    back = codec.decode_snapshot(head, f.submitted("r"))
    assert back.abort_reason is AbortReason.PAUSED and back.seq == after.seq
    assert msgpack.unpackb(codec.encode_snapshot(live)[5:])[0] == 3
    # What a v2 reader does with it: a version newer than its own is refused as newer.
    with pytest.raises(UnsupportedSchema, match="newer"):
        codec._upcast("aborted", 3, 2, {}, "r", 3)
