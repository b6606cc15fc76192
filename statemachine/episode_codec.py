"""Stored form of an episode's tool-call events, registered into ``codec.REGISTRY`` (the one
registry every record is decoded through). Each is at schema version 1 but
``tool_result_recorded`` (v2: shorter keys, ``EPISODE_UPCASTERS`` reads v1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statemachine.arrays import pack_array, unpack_array
from statemachine.episode import ToolEffect
from statemachine.episode_events import (
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolResultRecorded,
    TurnRequested,
)
from statemachine.events import Event
from statemachine.request import SamplingParams
from statemachine.status import ToolFailure

Fields = dict[str, Any]


def _requested(e: ToolCallRequested) -> Fields:
    return {
        "attempt": e.attempt,
        "offset": e.offset,
        "call_id": e.call_id,
        "name": e.name,
        "arguments": e.arguments,
        "idempotency_key": e.idempotency_key,
    }


def _claimed(e: ToolCallClaimed) -> Fields:
    return {"call_id": e.call_id, "runner_id": e.runner_id, "claim": e.claim}


def _result(e: ToolResultRecorded) -> Fields:
    # v2: one-letter keys. A result is the one tool record written at every turn of every
    # episode, and its observation is raw little-endian bytes (4 a token, like a chunk's
    # token ids); v1's spelled-out keys were half its overhead: 139 bytes over the payload,
    # 1.27x that of a 128-token observation with a short rollout id. v2: ~80, 1.16x; with a
    # batch's 36-character rollout ids in the record, 1.234x on bench/bench_episodes.py, back
    # to 1.157x since tool records are lean (no id, no seq: ``codec``).
    return {
        "c": e.call_id,
        "k": e.claim,
        "o": pack_array(e.observation_token_ids),
        "h": e.env_handle,
        "r": e.env_revision,
        "s": e.seconds,
    }


def _result_from(f: Fields) -> Fields:
    return {
        "call_id": f["c"],
        "claim": f["k"],
        "observation_token_ids": unpack_array(f["o"]),
        "env_handle": f["h"],
        "env_revision": f["r"],
        "seconds": f["s"],
    }


_V1_RESULT_KEYS = {
    "call_id": "c",
    "claim": "k",
    "observation_token_ids": "o",
    "env_handle": "h",
    "env_revision": "r",
    "seconds": "s",
}


def result_fields_v1(e: ToolResultRecorded) -> Fields:
    """A result's fields under v1's spelled-out keys: what a reader is shown (the HTTP API's
    event view), where v2's one-letter keys would say nothing."""
    return {long: _result(e)[short] for long, short in _V1_RESULT_KEYS.items()}


def _result_v1(f: Fields) -> Fields:
    """tool_result_recorded v1 -> v2: the same fields under v2's keys (a key missing from a
    damaged record stays missing, and the decoder refuses the record as corrupt)."""
    return {short: f[long] for long, short in _V1_RESULT_KEYS.items() if long in f}


def _turn(e: TurnRequested) -> Fields:
    # Short keys as a result's (v2): it is the record written at every turn of a harness's
    # session, and its observation is raw little-endian bytes like a result's.
    return {
        "c": e.call_id,
        "b": e.call_batch,
        "o": pack_array(e.observation_token_ids),
        "s": e.sampling.to_dict(),
    }


def _turn_from(f: Fields) -> Fields:
    return {
        "call_id": f["c"],
        "call_batch": f["b"],
        "observation_token_ids": unpack_array(f["o"]),
        "sampling": SamplingParams.from_dict(f["s"]),
    }


def _failed(e: ToolCallFailed) -> Fields:
    return {
        "call_id": e.call_id,
        "claim": e.claim,
        "failure": e.failure.value,
        "error": e.error,
        "seconds": e.seconds,
    }


def _lost(e: ToolCallLost) -> Fields:
    return {"call_id": e.call_id, "claim": e.claim, "decision": e.decision.value,
            "detail": e.detail}  # fmt: skip


# name -> (class, current schema version, to fields, from fields), as in ``codec.REGISTRY``.
_Codec = tuple[type[Event], int, Callable[[Any], Fields], Callable[[Fields], Fields]]
EPISODE_CODECS: dict[str, _Codec] = {
    "tool_call_requested": (ToolCallRequested, 1, _requested, dict),
    "tool_call_claimed": (ToolCallClaimed, 1, _claimed, dict),
    "tool_result_recorded": (ToolResultRecorded, 2, _result, _result_from),
    "tool_call_failed": (
        ToolCallFailed,
        1,
        _failed,
        lambda f: {**f, "failure": ToolFailure(f["failure"])},
    ),
    "tool_call_lost": (
        ToolCallLost,
        1,
        _lost,
        lambda f: {**f, "decision": ToolEffect(f["decision"])},
    ),
    "turn_requested": (TurnRequested, 1, _turn, _turn_from),
}

# (type name, stored version) -> the next version's fields, merged into ``codec.UPCASTERS``.
EPISODE_UPCASTERS: dict[tuple[str, int], Callable[[Fields], Fields]] = {
    ("tool_result_recorded", 1): _result_v1,
}
