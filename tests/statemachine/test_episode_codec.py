"""The stored form of episodes: new records at their versions, a plain rollout's records byte
for byte what they were, old records still decoding, and a snapshot head of an episode."""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest

from statemachine import (
    CorruptRecord,
    Event,
    Failed,
    FailureClass,
    Finished,
    FinishReason,
    RolloutState,
    Submitted,
    TokensAppended,
    ToolCallClaimed,
    ToolCallFailed,
    ToolResultRecorded,
    TurnRequested,
    UnsupportedSchema,
    apply,
    codec,
)
from statemachine.episode_events import TOOL_EVENTS
from tests import factories as f


def _forge(magic: bytes, body: list) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    return magic + zlib.crc32(packed).to_bytes(4, "little") + packed


def _forge_lean(body: list, rid: str, seq: int) -> bytes:
    """A lean record (b"r") around ``body``, its CRC over where it is stored and the body."""
    packed = msgpack.packb(body, use_bin_type=True)
    crc = zlib.crc32(packed, zlib.crc32(f"{rid}\x00{seq}".encode()))
    return b"r" + crc.to_bytes(4, "little") + packed


def _header(record: bytes) -> list:
    return msgpack.unpackb(record[5:], raw=False)


def _back(record: bytes, event: Event) -> Event:
    """``record`` read back where ``event`` is stored (a lean record needs to be told)."""
    return codec.decode(record, rollout_id=event.rollout_id, seq=event.seq)


def test_a_plain_rollouts_records_are_byte_for_byte_what_they_were() -> None:
    # Written as the code before episodes wrote them: submitted v3, finished v1, failed v2.
    request = f.request().to_dict()
    membership = {
        "batch_id": "",
        "group_index": 0,
        "sample_index": 0,
        "group_size": 1,
        "group_policy": "sample",
    }
    olds = [
        _forge(
            b"R",
            [
                "submitted",
                3,
                "r",
                1,
                0.0,
                {
                    "request": request,
                    "admitted_version": 0,
                    "queue": "rollouts",
                    "membership": membership,
                },
            ],
        ),
        _forge(
            b"R",
            ["finished", 1, "r", 4, 0.0, {"attempt": 1, "finish_reason": "stop", "stop_reason": 2}],
        ),
        _forge(
            b"R",
            ["failed", 2, "r", 4, 0.0, {"error": "x", "attempts": 1, "failure": "engine_error"}],
        ),
    ]
    for old in olds:
        assert codec.encode(codec.decode(old)) == old
    sub = codec.decode(olds[0])
    assert isinstance(sub, Submitted) and sub.request.episode is None
    state = apply(apply(None, sub), f.started(apply(None, sub)))
    assert _header(codec.encode_snapshot(state))[0] == 3


def test_episode_records_are_newer_versions_that_older_readers_refuse_as_newer() -> None:
    sub = f.episode_submitted(max_turns=4)
    s = apply(None, sub)
    s = apply(s, f.started(s))
    s = apply(s, f.tokens(s))
    s = apply(s, f.requested(s))
    cases = [
        (sub, "submitted", 5, 4),
        (f.budget_finished(s, FinishReason.MAX_TURNS), "finished", 2, 1),
        (
            Failed(rollout_id="r1", seq=5, error="x", attempts=1, failure=FailureClass.ENV_FATAL),
            "failed",
            3,
            2,
        ),
    ]
    for event, name, version, before in cases:
        record = codec.encode(event)
        assert _header(record)[:2] == [name, version]
        assert codec.decode(record) == event
        # What the reader that predates it does: a version newer than its own is "newer".
        with pytest.raises(UnsupportedSchema, match="newer"):
            codec._upcast(name, version, before, {}, "r1", event.seq)
    assert codec.decode(codec.encode(sub)).request.episode == sub.request.episode  # type: ignore[attr-defined]
    for cls in TOOL_EVENTS:
        name = next(n for n, (c, *_rest) in codec.REGISTRY.items() if c is cls)
        assert codec.REGISTRY[name][1] == (2 if cls is ToolResultRecorded else 1)


def _episode_state(rid: str = "r1") -> tuple[RolloutState, list]:
    events: list = [f.episode_submitted(rid)]
    s = apply(None, events[0])
    for make in (
        f.started,
        f.tokens,
        f.requested,
        f.claimed,
        f.call_lost,
        f.claimed,
        f.result,
        f.resumed,
        f.tokens,
        f.requested,
        f.claimed,
    ):
        events.append(make(s))
        s = apply(s, events[-1])
    return s, events


def test_an_episodes_snapshot_head_is_v5_and_decodes_with_its_tool_records() -> None:
    state, events = _episode_state()
    head = codec.encode_snapshot(state)
    assert _header(head)[0] == 5 and len(_header(head)) == 15  # v3's layout
    decoded = [_back(codec.encode(e), e) for e in events]
    chunks = tuple(e for e in decoded if isinstance(e, TokensAppended))
    tools = [e for e in decoded if isinstance(e, TOOL_EVENTS)]
    back = codec.decode_snapshot(head, decoded[0], chunks, tools)
    assert back == state and back.status.value == "running_tool"
    assert back.context_token_ids.tolist() == state.context_token_ids.tolist()
    # Without its tool records (a head-only read) it has no calls, and says so by being empty.
    assert codec.decode_snapshot(head, decoded[0]).calls == ()
    with pytest.raises(CorruptRecord, match="out of order"):
        codec.decode_snapshot(
            head, decoded[0], chunks, [t for t in tools if not isinstance(t, ToolCallClaimed)][1:]
        )


def test_a_v4_paused_head_and_a_v3_head_still_decode() -> None:
    sub = f.submitted("r")
    s = apply(None, sub)
    s = apply(s, f.started(s))
    v3 = _header(codec.encode_snapshot(s))
    assert codec.decode_snapshot(_forge(b"S", v3), sub) == s
    assert codec.decode_snapshot(_forge(b"S", [4, *v3[1:]]), sub) == s
    with pytest.raises(UnsupportedSchema):
        codec.decode_snapshot(_forge(b"S", [6, *v3[1:]]), sub)


def test_an_observation_is_stored_as_raw_bytes_near_its_payload() -> None:
    state, _ = _episode_state()
    n = 1000
    result = f.result(state, observation_token_ids=np.arange(n, dtype=np.int32))
    record = codec.encode(result)
    fields = _header(record)[3]
    assert fields["o"] == ["<i4", [n], np.arange(n, dtype="<i4").tobytes()]
    assert len(record) <= 1.2 * 4 * n
    assert _back(record, result) == result


def test_a_result_record_stays_within_1_2x_of_its_observation_with_a_real_rollout_id() -> None:
    # The rollout ids a batch gives (36 characters, e.g. "<32 hex>.15.0") and seqs of a long
    # episode: neither is stored (a v2 record with its id was 1.234x of a 128-token one).
    rid = "39d5839ff7e6415ebebc5ebfbc12307e.15.0"
    state, _ = _episode_state(rid)
    state = state.evolve(seq=state.seq + 1000)  # a seq past msgpack's one-byte integers
    for n in (128, 256, 4096):
        result = f.result(state, observation_token_ids=np.arange(n, dtype=np.int32) % 64)
        record = codec.encode(result)
        assert rid.encode() not in record
        assert len(record) <= 1.2 * 4 * n, (n, len(record))
        assert _back(record, result) == result


def test_tool_call_records_are_lean_and_read_only_where_they_are_stored() -> None:
    _, events = _episode_state("ep-1")
    tools = [e for e in events if isinstance(e, TOOL_EVENTS)]
    assert {type(e) for e in tools} == set(TOOL_EVENTS) - {ToolCallFailed, TurnRequested}
    for event in [*tools, f.call_failed(_episode_state("ep-1")[0]), _turn_requested("ep-1")]:
        record = codec.encode(event)
        assert record[:1] == codec.LEAN_MAGIC
        name, version, at, fields = _header(record)
        assert (version, at) == (codec.REGISTRY[name][1], event.at) and isinstance(fields, dict)
        assert _back(record, event) == event
        with pytest.raises(ValueError, match="rollout id and seq"):
            codec.decode(record)
        # Under another rollout or position its CRC does not hold: refused as damaged.
        for rid, seq in (("ep-2", event.seq), ("ep-1", event.seq + 1)):
            with pytest.raises(CorruptRecord, match="another rollout or position"):
                codec.decode(record, rollout_id=rid, seq=seq)
    # Every other record keeps its layout and says where it belongs.
    for event in events:
        if not isinstance(event, TOOL_EVENTS):
            assert codec.encode(event)[:1] == codec.EVENT_MAGIC
            assert _header(codec.encode(event))[2:4] == ["ep-1", event.seq]


def _turn_requested(rid: str) -> TurnRequested:
    """A harness-driven episode's next turn, as stored (lean, like every tool record)."""
    s = apply(None, f.harness_submitted(rid))
    for make in (f.started, f.tokens, lambda s: f.requested(s, "harness")):
        s = apply(s, make(s))
    return f.turn_requested(s)


def test_tool_records_written_before_they_were_lean_still_decode() -> None:
    _, events = _episode_state()
    for event in (e for e in events if isinstance(e, TOOL_EVENTS)):
        name, version, at, fields = _header(codec.encode(event))
        old = _forge(b"R", [name, version, event.rollout_id, event.seq, at, fields])
        assert codec.decode(old) == event == _back(old, event)


def test_a_lean_record_that_is_not_four_parts_is_refused() -> None:
    for body in (["tool_call_claimed", 1, 0.0], ["tool_call_claimed", 1, "r1", 5, 0.0, {}]):
        with pytest.raises(CorruptRecord, match="lean record is not"):
            codec.decode(_forge_lean(body, "r1", 5), rollout_id="r1", seq=5)
    with pytest.raises(UnsupportedSchema, match="newer"):
        codec.decode(_forge_lean(["tool_call_claimed", 9, 0.0, {}], "r1", 5), rollout_id="r1",
                     seq=5)  # fmt: skip


def test_a_v4_episode_submission_still_decodes_and_v4_readers_refuse_v5() -> None:
    sub = f.episode_submitted(max_turns=4)
    name, version, *rest = _header(codec.encode(sub))
    assert (name, version) == ("submitted", 5)
    old = _forge(b"R", [name, 4, *rest])  # written before tool records were lean
    assert codec.decode(old) == sub
    # The code before lean tool records reads v4 at most: it leaves a v5 episode to newer code
    # (CodecError: the worker backs off) instead of failing it on its first lean record.
    with pytest.raises(UnsupportedSchema, match="newer"):
        codec._upcast("submitted", 5, 4, {}, sub.rollout_id, 1)


def test_token_records_are_told_apart_without_decoding() -> None:
    s = apply(None, f.episode_submitted())
    s = apply(s, f.started(s))
    chunks = [f.tokens(s), f.tokens(s, top=2), f.tokens(s, routes=True)]
    assert all(codec.is_tokens_record(codec.encode(c)) for c in chunks)
    _, events = _episode_state()
    others = [e for e in events if not isinstance(e, TokensAppended)]
    assert not any(codec.is_tokens_record(codec.encode(e)) for e in others)
    assert not codec.is_tokens_record(b"") and not codec.is_tokens_record(b"R\x00")


def test_a_v1_result_record_still_decodes() -> None:
    state, _ = _episode_state()
    result = f.result(state, observation_token_ids=np.arange(5, dtype=np.int32), seconds=1.5)
    v1 = {
        "call_id": result.call_id,
        "claim": result.claim,
        "observation_token_ids": ["<i4", [5], np.arange(5, dtype="<i4").tobytes()],
        "env_handle": result.env_handle,
        "env_revision": result.env_revision,
        "seconds": 1.5,
    }
    at = result.at
    record = _forge(b"R", ["tool_result_recorded", 1, result.rollout_id, result.seq, at, v1])
    assert codec.decode(record) == result
    v2 = _header(codec.encode(result))[3]
    record = _forge(b"R", ["tool_result_recorded", 2, result.rollout_id, result.seq, at, v2])
    assert codec.decode(record) == result


def test_damaged_tool_records_are_refused() -> None:
    fields = {"call_id": "c1", "claim": 1, "failure": "meteor", "error": "", "seconds": 0.0}
    with pytest.raises(CorruptRecord, match="bad tool_call_failed fields"):
        codec.decode(_forge(b"R", ["tool_call_failed", 1, "r", 5, 0.0, fields]))
    with pytest.raises(CorruptRecord, match="bad tool_call_failed fields"):
        codec.decode(_forge_lean(["tool_call_failed", 1, 0.0, fields], "r", 5), rollout_id="r",
                     seq=5)  # fmt: skip
    result = f.result(_episode_state()[0])
    good = codec.encode(result)
    body = _header(good)
    body[3]["o"][2] = b"\x00" * 3  # 3 bytes for 3 int32 ids
    with pytest.raises(CorruptRecord, match="needs 12 bytes"):
        codec.decode(_forge_lean(body, result.rollout_id, result.seq),
                     rollout_id=result.rollout_id, seq=result.seq)  # fmt: skip
    assert isinstance(_back(good, result), ToolResultRecorded)
    damaged = bytearray(good)
    damaged[-1] ^= 1
    with pytest.raises(CorruptRecord, match="checksum mismatch"):
        _back(bytes(damaged), result)
    v1 = {"call_id": "c1", "claim": 1, "env_handle": "", "env_revision": "", "seconds": 0.0}
    with pytest.raises(CorruptRecord, match="bad tool_result_recorded fields"):
        codec.decode(_forge(b"R", ["tool_result_recorded", 1, "r", 5, 0.0, v1]))
    assert isinstance(codec.decode(codec.encode(f.budget_finished(_episode_state()[0]))), Finished)
