"""Stored form of events and snapshots: msgpack with a type name, a schema version and a CRC.

Record layout (bytes)::

    b"R" | crc32(body) as 4 bytes little-endian | body          (framing.py)
    body = msgpack [type_name, schema_version, rollout_id, seq, at, {field: value}]

An episode's tool-call events are stored lean: their rollout id and seq are where the record
is stored (the log's key, the entry id), so the body leaves them out and the CRC covers them::

    b"r" | crc32(rollout_id NUL seq + body) | body
    body = msgpack [type_name, schema_version, at, {field: value}]

Measured on ``bench/bench_episodes.py`` (36-character rollout ids, 128-token observations):
a result record's bytes beyond its 512-byte payload ~119 -> ~80, 1.234x -> 1.157x. Every
reader in store/ passes the rollout id and seq it read the record under, which a lean record
needs (``decode``).

Arrays travel as ``[dtype, shape, raw little-endian bytes]``, never as nested lists. Old
schema versions are upcast by small named functions registered in ``UPCASTERS`` before the
event is built. An episode's tool-call events have their codecs in ``episode_codec``, in the
same ``REGISTRY``; snapshot heads are in ``snapshot`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

# pack_array/unpack_array live with the dtypes they allow (arrays.py).
from statemachine.arrays import pack_array, unpack_array
from statemachine.episode_codec import EPISODE_CODECS, EPISODE_UPCASTERS
from statemachine.episode_events import TOOL_EVENTS
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
from statemachine.framing import (
    EVENT_MAGIC,
    LEAN_MAGIC,
    SNAPSHOT_MAGIC,
    frame,
    lean_context,
    magic_of,
    unframe,
    unpack,
)
from statemachine.request import DEFAULT_QUEUE, RolloutRequest
from statemachine.snapshot import (
    SNAPSHOT_SCHEMA,
    decode_snapshot,
    encode_snapshot,
    legacy_failure,
    snapshot_status,
)
from statemachine.status import EPISODE_FINISH, AbortReason, FailureClass, FinishReason

__all__ = [
    "EVENT_MAGIC",
    "LEAN_MAGIC",
    "REGISTRY",
    "SNAPSHOT_MAGIC",
    "SNAPSHOT_SCHEMA",
    "UPCASTERS",
    "decode",
    "decode_snapshot",
    "encode",
    "encode_snapshot",
    "is_tokens_record",
    "snapshot_status",
]

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
        **_optional_fields(e),
    }


def _optional_fields(e: TokensAppended) -> Fields:
    """The arrays only some chunks have, only when the chunk has them: a chunk with neither is
    stored as a v1 record, byte for byte what it was before they existed; the top-k arrays
    alone make it v2; observation routes make it v3, whose top-k keys are always present
    (null without them: a v3 record is never upcast through v1) (``_tokens_version``)."""
    obs, top_ids, top_lps = e.observation_routes, e.top_token_ids, e.top_logprobs
    if obs is None and (top_ids is None or top_lps is None):
        return {}
    top = {
        "top_token_ids": None if top_ids is None else pack_array(top_ids),
        "top_logprobs": None if top_lps is None else pack_array(top_lps),
    }
    return top if obs is None else {**top, "observation_routes": pack_array(obs)}


def _tokens_version(e: TokensAppended) -> int:
    """v2 only for a chunk with top-k arrays, v3 only for one with observation routes: a reader
    that predates them refuses such a record (``UnsupportedSchema``) instead of reading it
    without them."""
    if e.observation_routes is not None:
        return 3
    return 1 if e.top_token_ids is None else 2


def _tokens_from(f: Fields) -> Fields:
    routes, top_ids, top_lps = f["routed_experts"], f["top_token_ids"], f["top_logprobs"]
    obs = f["observation_routes"]
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
        "observation_routes": None if obs is None else unpack_array(obs),
    }


# name -> (class, current schema version, to fields, from fields)
_Codec = tuple[type[Event], int, Callable[[Any], Fields], Callable[[Fields], Fields]]
REGISTRY: dict[str, _Codec] = {
    "submitted": (
        Submitted,
        6,
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
    "tokens_appended": (TokensAppended, 3, _tokens_fields, _tokens_from),
    "aborted": (
        Aborted,
        3,
        lambda e: {"attempt": e.attempt, "reason": e.reason.value, "detail": e.detail},
        lambda f: {**f, "reason": AbortReason(f["reason"])},
    ),
    "finished": (
        Finished,
        3,
        lambda e: {
            "attempt": e.attempt,
            "finish_reason": e.finish_reason.value,
            "stop_reason": e.stop_reason,
        },
        lambda f: {**f, "finish_reason": FinishReason(f["finish_reason"])},
    ),
    "failed": (
        Failed,
        3,
        lambda e: {"error": e.error, "attempts": e.attempts, "failure": e.failure.value},
        lambda f: {**f, "failure": FailureClass(f["failure"])},
    ),
    "cancelled": (Cancelled, 1, lambda e: {"reason": e.reason}, dict),
    **EPISODE_CODECS,
}
_NAME_OF: dict[type[Event], str] = {cls: name for name, (cls, *_rest) in REGISTRY.items()}


def _no_top_logprobs(f: Fields) -> Fields:
    """tokens_appended v1 -> v2: a v1 chunk has no top-k arrays (its request asked for none)."""
    return {**f, "top_token_ids": None, "top_logprobs": None}


def _no_observation_routes(f: Fields) -> Fields:
    """tokens_appended v2 -> v3: a v2 chunk has no observation routes (none were recorded)."""
    return {**f, "observation_routes": None}


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


def _submitted_version(e: Submitted) -> int:
    """v4 (its request may carry an ``episode``) only for an episode: a plain rollout's record
    is byte for byte what it was, and code that predates episodes refuses an episode's record
    as newer instead of running it as a plain rollout. v5 (v4's fields) for every episode
    since its tool-call records are lean (``LEAN_MAGIC``): code that reads v4 at most would take
    those for damaged records and fail the episode; it refuses the episode as newer instead
    (it reads the Submitted record first), leaving it to a newer worker or runner. v6 (the
    episode may be harness-driven) only for a harness-driven one, for the same reason."""
    episode = e.request.episode
    if episode is None:
        return 3
    return 6 if episode.harness else 5


def _finished_version(e: Finished) -> int:
    """v2 (it adds the episode budget reasons) only for those reasons, as ``_aborted_version``;
    v3 (it adds ``session_end``) only for that one."""
    if e.finish_reason is FinishReason.SESSION_END:
        return 3
    return 2 if e.finish_reason in EPISODE_FINISH else 1


# The failure classes that end an episode at a tool call (failed v3).
_EPISODE_FAILURES = frozenset(
    {FailureClass.ENV_FATAL, FailureClass.ENV_ERROR, FailureClass.EFFECT_UNVERIFIED}
)


def _failed_version(e: Failed) -> int:
    """v3 (it adds the episode failure classes) only for those classes."""
    return 3 if e.failure in _EPISODE_FAILURES else 2


def _failure_classed(f: Fields) -> Fields:
    """failed v1 -> v2: the class was not recorded; inferred from the error text."""
    return {**f, "failure": legacy_failure(f.get("error")).value}


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
    ("tokens_appended", 2): _no_observation_routes,
    # These versions add values (an optional request field, reasons, classes), no field:
    ("submitted", 3): dict,
    ("submitted", 4): dict,  # v5 marks an episode whose tool-call records are lean
    ("submitted", 5): dict,  # v6 a harness-driven episode
    ("finished", 1): dict,
    ("finished", 2): dict,
    ("failed", 2): dict,
    **EPISODE_UPCASTERS,
}
# Event types whose version depends on the event (the rest always write the current one).
_VERSION_OF: dict[type[Event], Callable[[Any], int]] = {
    TokensAppended: _tokens_version,
    Aborted: _aborted_version,
    Submitted: _submitted_version,
    Finished: _finished_version,
    Failed: _failed_version,
}


# -- events -------------------------------------------------------------------------------------


# Types stored lean (``LEAN_MAGIC``): an episode's tool-call events, which only episodes write
# (a plain rollout's records keep their bytes), and which every turn of an episode writes.
_LEAN: frozenset[type[Event]] = frozenset(TOOL_EVENTS)


def encode(event: Event) -> bytes:
    name = _NAME_OF[type(event)]
    _, version, to_fields, _ = REGISTRY[name]
    versioned = _VERSION_OF.get(type(event))
    if versioned is not None:
        version = versioned(event)
    if type(event) in _LEAN:
        body = msgpack.packb([name, version, event.at, to_fields(event)], use_bin_type=True)
        return frame(LEAN_MAGIC, body, lean_context(event.rollout_id, event.seq))
    body = msgpack.packb(
        [name, version, event.rollout_id, event.seq, event.at, to_fields(event)],
        use_bin_type=True,
    )
    return frame(EVENT_MAGIC, body)


def decode(record: bytes, *, rollout_id: str | None = None, seq: int | None = None) -> Event:
    """Decode one stored event. ``rollout_id``/``seq`` say where it was read from, for errors
    and to catch a record that is intact but stored under the wrong key or position; a lean
    record (an episode's tool-call event) cannot be read without them (``ValueError``)."""
    if magic_of(record) == LEAN_MAGIC:
        return _decode_lean(record, rollout_id, seq)
    body = unframe(EVENT_MAGIC, record, rollout_id, seq)
    try:
        name, version, rid, eseq, at, fields = unpack(body)
    except (TypeError, ValueError):
        # Intact checksum but not a 6-element list: written by something that is not us.
        raise CorruptRecord(
            "record is not [type, version, id, seq, at, fields]", rollout_id=rollout_id, seq=seq
        ) from None
    if (rollout_id is not None and rid != rollout_id) or (seq is not None and eseq != seq):
        raise CorruptRecord(
            f"record says rollout {rid!r} event #{eseq}", rollout_id=rollout_id, seq=seq
        )
    return _event(name, version, rid, eseq, at, fields)


def _decode_lean(record: bytes, rollout_id: str | None, seq: int | None) -> Event:
    if rollout_id is None or seq is None:
        raise ValueError("a lean record is read with the rollout id and seq it is stored under")
    body = unframe(LEAN_MAGIC, record, rollout_id, seq, lean_context(rollout_id, seq))
    try:
        name, version, at, fields = unpack(body)
    except (TypeError, ValueError):
        raise CorruptRecord(
            "lean record is not [type, version, at, fields]", rollout_id=rollout_id, seq=seq
        ) from None
    return _event(name, version, rollout_id, seq, at, fields)


def _event(name: Any, version: Any, rid: Any, eseq: Any, at: Any, fields: Any) -> Event:
    """The event of a record's unpacked parts, its fields upcast to the current version."""
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


# A token record begins with these bytes after its frame's 5: the 6-element list, then its
# type name (``encode``). Token records are never lean.
_TOKENS_HEAD = b"\x96" + msgpack.packb("tokens_appended")


def is_tokens_record(record: bytes) -> bool:
    """Whether a stored record is a ``TokensAppended`` one, told from its first bytes without
    checking or decoding it: for a reader that wants every record but the token data
    (``EventStore.head`` of an episode: at the end of a 16-turn bench_episodes episode, its
    log decoded whole took 1.96 ms of CPU, without its token records 0.77, measured). The
    reads that take token data check those records."""
    return record[:1] == EVENT_MAGIC and record[5 : 5 + len(_TOKENS_HEAD)] == _TOKENS_HEAD


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
