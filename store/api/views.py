"""The trainer API's objects as response bodies (plain dicts; arrays packed, see ``wire``).

Shapes are those of the response models in ``schemas`` (the tests check every response
against the served document); dicts rather than models because the result stream builds one
per rollout and a model round trip would cost more than the rest of the line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import Event, RolloutState, codec
from statemachine.arrays import unpack_array
from statemachine.episode_codec import result_fields_v1
from statemachine.episode_events import ToolResultRecorded
from store.batches import BatchInfo
from store.lifecycle import AckReport
from store.results import RolloutResult
from store.sessions import SessionCall
from store.stats import Stats
from store.trajectory import Trajectory
from store.weights import WeightVersion

from .wire import packed

_TOKENS = np.dtype("<i4")
# event class -> (its stored type name, its codec's to-fields function)
_CODECS = {cls: (name, to_fields) for name, (cls, _, to_fields, _) in codec.REGISTRY.items()}
# Stored under one-letter keys (statemachine/episode_codec.py says why): shown spelled out.
_CODECS[ToolResultRecorded] = ("tool_result_recorded", result_fields_v1)


def _ids(ids: Any) -> dict[str, Any]:
    """Prompt token ids packed: int32 like response ids, int64 when one does not fit (the
    request type allows any id below 2**63; no tokenizer has one that large)."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size == 0 or int(arr.max()) < 2**31:
        arr = arr.astype(_TOKENS)
    return packed(arr)


def _value(v: Any) -> Any:
    return None if v is None else getattr(v, "value", v)


def result(r: RolloutResult) -> dict[str, Any]:
    out = {
        "rollout_id": r.rollout_id,
        "status": r.status.value,
        "prompt_token_ids": _ids(r.prompt_token_ids),
        "response_token_ids": packed(r.response_token_ids),
        "logprobs": packed(r.logprobs),
        "weight_versions": packed(r.weight_versions),
        "routed_experts": None if r.routed_experts is None else packed(r.routed_experts),
        "finish_reason": _value(r.finish_reason),
        "stop_reason": r.stop_reason,
        "text": r.text,
        "error": r.error,
        "failure": _value(r.failure),
        "attempts": r.attempts,
        "aborts": r.aborts,
        "nonfinite_logprobs": r.nonfinite_logprobs,
        "stale": r.stale,
        "group_id": r.group_id,
        "metadata": r.metadata,
        "admitted_version": r.admitted_version,
        "max_staleness": r.max_staleness,
        "batch_id": r.batch_id,
        "group_index": r.group_index,
        "sample_index": r.sample_index,
        "group_size": r.group_size,
        "position": r.position,
        "top_token_ids": None if r.top_token_ids is None else packed(r.top_token_ids),
        "top_logprobs": None if r.top_logprobs is None else packed(r.top_logprobs),
    }
    if r.loss_mask is not None:  # an episode: a plain rollout's body stays what it was
        out.update(_episode(r))
    return out


def _episode(r: RolloutResult) -> dict[str, Any]:
    present = r.routes_present
    return {
        "loss_mask": packed(r.loss_mask),  # type: ignore[arg-type]  # set for an episode
        "turns": [list(t) for t in r.turns or ()],
        "tool_calls": [c.to_dict() for c in r.tool_calls or ()],
        # uint8 on the wire: the packed dtypes are those numpy and every client share.
        "routes_present": None if present is None else packed(present.astype(np.uint8)),
    }


def rollout(state: RolloutState) -> dict[str, Any]:
    """A rollout now: its result so far plus where it runs."""
    return {
        **result(RolloutResult.from_state(state)),
        "seq": state.seq,
        "worker_id": state.worker_id,
        "weight_version": state.weight_version,
        "model": state.model,
        "queue": state.queue,
        "submitted_at": state.submitted_at,
        "abort_reason": _value(state.abort_reason),
        "sampling": state.request.sampling.to_dict(),
    }


def event(e: Event) -> dict[str, Any]:
    """An event as its codec stores it (type name, fields), arrays as packed dicts."""
    name, to_fields = _CODECS[type(e)]
    return {"type": name, "seq": e.seq, "at": e.at, "fields": _readable(to_fields(e))}


def _readable(value: Any) -> Any:
    """The codec's fields with its ``[dtype, shape, bytes]`` arrays as packed dicts, and the
    submitted prompt's token ids packed as well (the one long list a record holds)."""
    if isinstance(value, dict):
        out = {k: _readable(v) for k, v in value.items()}
        ids = out.get("prompt_token_ids")
        if isinstance(ids, list):
            out["prompt_token_ids"] = _ids(ids)
        return out
    if isinstance(value, list):
        if len(value) == 3 and isinstance(value[2], memoryview | bytes):
            return packed(unpack_array([value[0], value[1], bytes(value[2])]))
        return [_readable(v) for v in value]
    return value


def batch(info: BatchInfo) -> dict[str, Any]:
    return {
        "batch_id": info.batch_id,
        "groups": info.groups,
        "group_size": info.group_size,
        "queue": info.queue,
        "submitted_at": info.submitted_at,
        "retention_s": info.retention_s,
        "ids": info.ids,
    }


def session(session_id: str, calls: list[SessionCall]) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "calls": [{"batch_id": c.batch_id, "at": c.at, "group_size": c.info.group_size,
                   "ids": c.ids, "states": list(c.statuses)} for c in calls],
    }  # fmt: skip


def trajectory(t: Trajectory) -> dict[str, Any]:
    segments = [
        {"start": s.start.value, "prompt_token_ids": _ids(s.prompt_token_ids),
         "token_ids": packed(s.token_ids), "loss_mask": packed(s.loss_mask),
         "logprobs": packed(s.logprobs), "weight_versions": packed(s.weight_versions),
         "turns": [list(span) for span in s.turns],
         "calls": [{"batch_id": c.batch_id, "rollout_id": c.rollout_id, "sample": c.sample,
                    "status": c.status, "start": c.start, "response_start": c.response_start,
                    "end": c.end} for c in s.calls]}
        for s in t.segments
    ]  # fmt: skip
    return {"session_id": t.session_id, "status": t.status.value, "segments": segments,
            "breaks": t.breaks, "gone": list(t.gone)}  # fmt: skip


def ack(report: AckReport) -> dict[str, Any]:
    return {"acked": report.acked, "live": report.live, "missing": report.missing}


def weight(w: WeightVersion) -> dict[str, Any]:
    return {"version": w.version, "path": w.path, "at": w.at}


def stats(s: Stats, latest: WeightVersion | None) -> dict[str, Any]:
    now = s.now  # Redis's clock, as the heartbeats are stamped
    return {
        "by_state": {k.value: v for k, v in s.by_state.items()},
        "tokens": s.tokens,
        "in_flight": s.in_flight,
        "queues": s.queues,
        "workers": [
            {
                "worker_id": w.worker_id,
                "in_flight": w.in_flight,
                "weight_version": w.weight_version,
                "queues": list(w.queues),
                "model": w.model,
                "heartbeat_age_s": round(max(0.0, w.age_s(now)), 3),
            }
            for w in s.workers
        ],
        "latest_weight_version": None if latest is None else latest.version,
    }
