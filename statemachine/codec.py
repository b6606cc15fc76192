"""Stored form of events and snapshots: msgpack with a type name, a schema version and a CRC.

Record layout (bytes)::

    b"R" | crc32(body) as 4 bytes little-endian | body
    body = msgpack [type_name, schema_version, rollout_id, seq, at, {field: value}]

Arrays travel as ``[dtype, shape, raw little-endian bytes]``, never as nested lists. The CRC
is there so that damaged bytes are always refused: msgpack alone would happily decode a flipped
bit inside a token id as another token id. Old schema versions are upcast by small named
functions registered in ``UPCASTERS`` before the event is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

try:
    # zlib-ng's CRC-32 is zlib's (same polynomial, same values: records written either way read
    # either way) at ~15x the speed: 0.36 vs 5.3 us for a 13 KB chunk, measured. Every chunk is
    # checksummed once when written and once per read. zlib stays the fallback for a platform
    # without a zlib-ng wheel.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

# pack_array/unpack_array live with the dtypes they allow (arrays.py).
from statemachine.arrays import pack_array, unpack_array
from statemachine.errors import (
    CorruptRecord,
    StateMachineError,
    UnknownEventType,
    UnsupportedSchema,
)
from statemachine.events import (
    Aborted,
    Cancelled,
    Event,
    Failed,
    Finished,
    Membership,
    Resumed,
    Started,
    Submitted,
    TokensAppended,
)
from statemachine.request import DEFAULT_QUEUE, RolloutRequest
from statemachine.rollout_state import RolloutState
from statemachine.status import AbortReason, FailureClass, FinishReason, Status

EVENT_MAGIC = b"R"
SNAPSHOT_MAGIC = b"S"
# v2 appends the model of the rollout's attempts; a v1 head decodes with model "" (unknown).
# v3 appends the failure class of a failed rollout; a v2 head infers it (``_legacy_failure``).
# v4 is v3's layout, written only for a head whose abort reason is ``paused`` (``encode_snapshot``):
# code that predates the reason refuses such a head as newer (``UnsupportedSchema``, left to a
# newer worker) instead of calling it corrupt; every other head is still written as v3.
SNAPSHOT_SCHEMA = 4
_SNAPSHOT_READ = frozenset({3, 4})

Fields = dict[str, Any]


# -- per-type fields ----------------------------------------------------------------------------


def _attempt_fields(e: Started | Resumed) -> Fields:
    return {
        "attempt": e.attempt,
        "worker_id": e.worker_id,
        "weight_version": e.weight_version,
        "weight_mode": e.weight_mode,
        "model": e.model,
    }


def _tokens_fields(e: TokensAppended) -> Fields:
    return {
        "attempt": e.attempt,
        "offset": e.offset,
        "token_ids": pack_array(e.token_ids),
        "logprobs": pack_array(e.logprobs),
        "weight_versions": pack_array(e.weight_versions),
        "routed_experts": None if e.routed_experts is None else pack_array(e.routed_experts),
        "nonfinite_logprobs": e.nonfinite_logprobs,
        **_top_fields(e),
    }


def _top_fields(e: TokensAppended) -> Fields:
    """The top-k arrays, only when the chunk has them: a chunk without them is stored as a v1
    record, byte for byte what it was before they existed (``_tokens_version``)."""
    if e.top_token_ids is None or e.top_logprobs is None:
        return {}
    return {
        "top_token_ids": pack_array(e.top_token_ids),
        "top_logprobs": pack_array(e.top_logprobs),
    }


def _tokens_version(e: TokensAppended) -> int:
    """v2 only for a chunk with top-k arrays: a reader that predates them refuses such a record
    (``UnsupportedSchema``) instead of reading it without its top-k."""
    return 1 if e.top_token_ids is None else 2


def _tokens_from(f: Fields) -> Fields:
    routes, top_ids, top_lps = f["routed_experts"], f["top_token_ids"], f["top_logprobs"]
    return {
        "attempt": f["attempt"],
        "offset": f["offset"],
        "token_ids": unpack_array(f["token_ids"]),
        "logprobs": unpack_array(f["logprobs"]),
        "weight_versions": unpack_array(f["weight_versions"]),
        "routed_experts": None if routes is None else unpack_array(routes),
        "nonfinite_logprobs": f["nonfinite_logprobs"],
        "top_token_ids": None if top_ids is None else unpack_array(top_ids),
        "top_logprobs": None if top_lps is None else unpack_array(top_lps),
    }


# name -> (class, current schema version, to fields, from fields)
_Codec = tuple[type[Event], int, Callable[[Any], Fields], Callable[[Fields], Fields]]
REGISTRY: dict[str, _Codec] = {
    "submitted": (
        Submitted,
        3,
        lambda e: {
            "request": e.request.to_dict(),
            "admitted_version": e.admitted_version,
            "queue": e.queue,
            "membership": e.membership.to_dict(),
        },
        lambda f: {
            "request": RolloutRequest.from_dict(f["request"]),
            "admitted_version": f["admitted_version"],
            "queue": f["queue"],
            "membership": Membership(**f["membership"]),
        },
    ),
    "started": (Started, 2, _attempt_fields, dict),
    "resumed": (Resumed, 2, _attempt_fields, dict),
    "tokens_appended": (TokensAppended, 2, _tokens_fields, _tokens_from),
    "aborted": (
        Aborted,
        3,
        lambda e: {"attempt": e.attempt, "reason": e.reason.value, "detail": e.detail},
        lambda f: {**f, "reason": AbortReason(f["reason"])},
    ),
    "finished": (
        Finished,
        1,
        lambda e: {
            "attempt": e.attempt,
            "finish_reason": e.finish_reason.value,
            "stop_reason": e.stop_reason,
        },
        lambda f: {**f, "finish_reason": FinishReason(f["finish_reason"])},
    ),
    "failed": (
        Failed,
        2,
        lambda e: {"error": e.error, "attempts": e.attempts, "failure": e.failure.value},
        lambda f: {**f, "failure": FailureClass(f["failure"])},
    ),
    "cancelled": (Cancelled, 1, lambda e: {"reason": e.reason}, dict),
}
_NAME_OF: dict[type[Event], str] = {cls: name for name, (cls, *_rest) in REGISTRY.items()}


def _no_top_logprobs(f: Fields) -> Fields:
    """tokens_appended v1 -> v2: a v1 chunk has no top-k arrays (its request asked for none)."""
    return {**f, "top_token_ids": None, "top_logprobs": None}


def _queue_recorded(f: Fields) -> Fields:
    """submitted v1 -> v2: v1 did not record the queue. Such rollouts were submitted by code
    that, unless told otherwise, used the default queue: the best guess there is."""
    return {**f, "queue": DEFAULT_QUEUE}


def _model_recorded(f: Fields) -> Fields:
    """started/resumed v1 -> v2: the model was not recorded; "" is "unknown", which the
    transitions accept next to any model (no check is possible against it)."""
    return {**f, "model": ""}


def _engine_dead_named(f: Fields) -> Fields:
    """aborted v1 -> v2: v1 had no ``engine_dead`` reason; the worker recorded an engine's
    death as ``engine_error`` with a detail starting "EngineDead:". Parsed here, once, so no
    other code reads the detail to tell the two apart."""
    if f.get("reason") == "engine_error" and str(f.get("detail", "")).startswith("EngineDead:"):
        return {**f, "reason": "engine_dead"}
    return f


def _aborted_version(e: Aborted) -> int:
    """v3 (it adds the ``paused`` reason) only for that reason, as ``_tokens_version`` does:
    older code refuses it as newer (a newer worker runs it), never as corrupt."""
    return 3 if e.reason is AbortReason.PAUSED else 2


def _no_batch(f: Fields) -> Fields:
    """submitted v2 -> v3: rollouts submitted before batches existed belong to none; each is
    a group of one."""
    return {**f, "membership": Membership().to_dict()}


def _legacy_failure(error: str | None) -> FailureClass:
    """The failure class of a failure recorded before classes were: the worker wrote
    "unreadable record: ..." for records it could not decode; every other failure then was a
    rollout that used up its engine-error budget."""
    if (error or "").startswith("unreadable record"):
        return FailureClass.UNREADABLE
    return FailureClass.ENGINE_ERROR


def _failure_classed(f: Fields) -> Fields:
    """failed v1 -> v2: the class was not recorded; inferred from the error text."""
    return {**f, "failure": _legacy_failure(f.get("error")).value}


# (type name, stored version) -> function turning those fields into the next version's fields.
UPCASTERS: dict[tuple[str, int], Callable[[Fields], Fields]] = {
    ("submitted", 1): _queue_recorded,
    ("submitted", 2): _no_batch,
    ("failed", 1): _failure_classed,
    ("started", 1): _model_recorded,
    ("resumed", 1): _model_recorded,
    ("aborted", 1): _engine_dead_named,
    ("aborted", 2): dict,  # v3 adds a reason value, no field
    ("tokens_appended", 1): _no_top_logprobs,
}
# Event types whose version depends on the event (the rest always write the current one).
_VERSION_OF: dict[type[Event], Callable[[Any], int]] = {
    TokensAppended: _tokens_version,
    Aborted: _aborted_version,
}


# -- events -------------------------------------------------------------------------------------


def encode(event: Event) -> bytes:
    name = _NAME_OF[type(event)]
    _, version, to_fields, _ = REGISTRY[name]
    versioned = _VERSION_OF.get(type(event))
    if versioned is not None:
        version = versioned(event)
    body = msgpack.packb(
        [name, version, event.rollout_id, event.seq, event.at, to_fields(event)],
        use_bin_type=True,
    )
    return _frame(EVENT_MAGIC, body)


def decode(record: bytes, *, rollout_id: str | None = None, seq: int | None = None) -> Event:
    """Decode one stored event. ``rollout_id``/``seq`` say where it was read from, for errors
    and to catch a record that is intact but stored under the wrong key or position."""
    body = _unframe(EVENT_MAGIC, record, rollout_id, seq)
    try:
        name, version, rid, eseq, at, fields = _unpack(body)
    except (TypeError, ValueError):
        # Intact checksum but not a 6-element list: written by something that is not us.
        raise CorruptRecord(
            "record is not [type, version, id, seq, at, fields]", rollout_id=rollout_id, seq=seq
        ) from None
    if (rollout_id is not None and rid != rollout_id) or (seq is not None and eseq != seq):
        raise CorruptRecord(
            f"record says rollout {rid!r} event #{eseq}", rollout_id=rollout_id, seq=seq
        )
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise UnknownEventType(f"unknown event type {name!r}", rollout_id=rid, seq=eseq)
    cls, current, _, from_fields = entry
    if not isinstance(version, int) or not isinstance(fields, dict) or not _is_time(at):
        raise CorruptRecord("bad schema version or fields", rollout_id=rid, seq=eseq)
    fields = _upcast(name, version, current, fields, rid, eseq)
    try:
        return cls(rollout_id=rid, seq=eseq, at=float(at), **from_fields(fields))
    except (KeyError, TypeError, ValueError, StateMachineError) as exc:
        # A missing or ill-typed field, or values the event itself refuses.
        raise CorruptRecord(f"bad {name} fields: {exc}", rollout_id=rid, seq=eseq) from None


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _upcast(name: str, version: int, current: int, fields: Fields, rid: Any, seq: Any) -> Fields:
    if version > current:
        raise UnsupportedSchema(
            f"{name} schema v{version} is newer than this code (v{current})",
            rollout_id=rid,
            seq=seq,
        )
    while version < current:
        step = UPCASTERS.get((name, version))
        if step is None:
            raise UnsupportedSchema(
                f"no upcaster for {name} schema v{version}", rollout_id=rid, seq=seq
            )
        fields, version = step(fields), version + 1
    return fields


# -- snapshots: the mutable scalars of a state. The request lives in the Submitted record and
# the token data in the log's TokensAppended records, so nothing is stored twice and a
# snapshot update stays a few dozen bytes however long the prompt or the rollout.


def encode_snapshot(state: RolloutState) -> bytes:
    body = msgpack.packb(
        [
            SNAPSHOT_SCHEMA if state.abort_reason is AbortReason.PAUSED else 3,
            state.rollout_id,
            state.seq,
            state.status.value,
            state.attempt,
            state.worker_id,
            state.weight_version,
            state.num_tokens,
            state.aborts,
            None if state.abort_reason is None else state.abort_reason.value,
            None if state.finish_reason is None else state.finish_reason.value,
            state.stop_reason,
            state.error,
            state.model,
            None if state.failure is None else state.failure.value,
        ],
        use_bin_type=True,
    )
    return _frame(SNAPSHOT_MAGIC, body)


def decode_snapshot(
    record: bytes,
    submitted: Submitted,
    chunks: tuple[TokensAppended, ...] = (),
) -> RolloutState:
    """The state a snapshot head describes, completed by the rollout's Submitted event and
    (when the caller wants token data) its TokensAppended events."""
    rollout_id = submitted.rollout_id
    body = _unframe(SNAPSHOT_MAGIC, record, rollout_id, None)
    try:
        fields = _unpack(body)
        if isinstance(fields, list) and len(fields) == 13 and fields[0] == 1:
            fields = [2, *fields[1:], ""]  # v1 -> v2: the model was not recorded
        if isinstance(fields, list) and len(fields) == 14 and fields[0] == 2:
            # v2 -> v3: the failure class was not recorded.
            legacy = _legacy_failure(fields[12]).value if fields[3] == "failed" else None
            fields = [3, *fields[1:], legacy]
        (
            version,
            rid,
            seq,
            status,
            attempt,
            worker_id,
            weight_version,
            num_tokens,
            aborts,
            abort_reason,
            finish_reason,
            stop_reason,
            error,
            model,
            failure,
        ) = fields
    except (TypeError, ValueError):
        # Wrong arity: the head was not written by this code.
        raise CorruptRecord("bad snapshot layout", rollout_id=rollout_id) from None
    if version not in _SNAPSHOT_READ:
        raise UnsupportedSchema(f"snapshot schema v{version}", rollout_id=rollout_id, seq=seq)
    if rid != rollout_id:
        raise CorruptRecord(f"snapshot says rollout {rid!r}", rollout_id=rollout_id)
    try:
        return RolloutState(
            rollout_id=rid,
            seq=seq,
            status=Status(status),
            request=submitted.request,
            submitted_at=submitted.at,
            admitted_version=submitted.admitted_version,
            queue=submitted.queue,
            membership=submitted.membership,
            model=model,
            attempt=attempt,
            worker_id=worker_id,
            weight_version=weight_version,
            num_tokens=num_tokens,
            chunks=chunks,
            aborts=aborts,
            abort_reason=None if abort_reason is None else AbortReason(abort_reason),
            finish_reason=None if finish_reason is None else FinishReason(finish_reason),
            stop_reason=stop_reason,
            error=error,
            failure=None if failure is None else FailureClass(failure),
        )
    except ValueError as exc:
        # An enum value this code does not know.
        raise CorruptRecord(f"bad snapshot: {exc}", rollout_id=rollout_id, seq=seq) from None


def snapshot_status(record: bytes, *, rollout_id: str | None = None) -> str:
    """Just the status of a snapshot head, without building the state (for cheap polling)."""
    body = _unframe(SNAPSHOT_MAGIC, record, rollout_id, None)
    try:
        status = _unpack(body)[3]
        return Status(status).value
    except (TypeError, ValueError, IndexError):
        # Not a head this code wrote.
        raise CorruptRecord("bad snapshot layout", rollout_id=rollout_id) from None


# -- framing ------------------------------------------------------------------------------------


def _frame(magic: bytes, body: bytes) -> bytes:
    return magic + crc32(body).to_bytes(4, "little") + body


def _unframe(magic: bytes, record: bytes, rollout_id: str | None, seq: int | None) -> bytes:
    if not isinstance(record, bytes | bytearray | memoryview):
        raise CorruptRecord(
            f"record is {type(record).__name__}, not bytes", rollout_id=rollout_id, seq=seq
        )
    record = bytes(record)
    if len(record) < 6 or record[:1] != magic:
        raise CorruptRecord("truncated record or wrong magic byte", rollout_id=rollout_id, seq=seq)
    body = record[5:]
    if crc32(body) != int.from_bytes(record[1:5], "little"):
        raise CorruptRecord(
            "checksum mismatch: record damaged or truncated", rollout_id=rollout_id, seq=seq
        )
    return body


def _unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        # Checksum matched yet msgpack refuses it: the writer itself produced garbage.
        raise ValueError(f"undecodable msgpack: {exc}") from None
