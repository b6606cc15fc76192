"""Stored form of an episode's tool-call events, registered into ``codec.REGISTRY`` (the one
registry every record is decoded through). Each is at schema version 1."""

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
)
from statemachine.events import Event
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
    return {
        "call_id": e.call_id,
        "claim": e.claim,
        # Raw little-endian bytes like a chunk's token ids: 4 bytes a token, so an
        # observation's record costs its payload plus a few dozen bytes.
        "observation_token_ids": pack_array(e.observation_token_ids),
        "env_handle": e.env_handle,
        "env_revision": e.env_revision,
        "seconds": e.seconds,
    }


def _result_from(f: Fields) -> Fields:
    return {**f, "observation_token_ids": unpack_array(f["observation_token_ids"])}


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
    "tool_result_recorded": (ToolResultRecorded, 1, _result, _result_from),
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
}
