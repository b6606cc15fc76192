"""Builders for requests and events, so tests say only what matters to them."""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import (
    Aborted,
    AbortReason,
    Cancelled,
    EpisodeSpec,
    Failed,
    Finished,
    FinishReason,
    Resumed,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    Started,
    Submitted,
    TokensAppended,
    ToolCallClaimed,
    ToolCallFailed,
    ToolCallLost,
    ToolCallRequested,
    ToolEffect,
    ToolFailure,
    ToolResultRecorded,
    ToolSpec,
    TurnRequested,
)


def request(
    max_tokens: int = 16, prompt: tuple[int, ...] = (1, 2, 3), **sampling: Any
) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, **sampling)
    )


def submitted(rid: str = "r1", max_tokens: int = 16, **kw: Any) -> Submitted:
    return Submitted(rollout_id=rid, seq=1, request=request(max_tokens, **kw))


def started(s: RolloutState, worker: str = "w1", version: int = 0, model: str = "") -> Started:
    return Started(
        rollout_id=s.rollout_id,
        seq=s.seq + 1,
        attempt=s.attempt + 1,
        worker_id=worker,
        weight_version=version,
        model=model,
    )


def resumed(s: RolloutState, worker: str = "w2", version: int = 0, model: str = "") -> Resumed:
    return Resumed(
        rollout_id=s.rollout_id,
        seq=s.seq + 1,
        attempt=s.attempt + 1,
        worker_id=worker,
        weight_version=version,
        model=model,
    )


def tokens(
    s: RolloutState,
    ids: list[int] | None = None,
    *,
    n: int = 4,
    version: int = 0,
    routes: bool = False,
    attempt: int | None = None,
    offset: int | None = None,
    seq: int | None = None,
    top: int | None = None,
    observed: int = 0,
) -> TokensAppended:
    """``top``: the width of top-k arrays (default: what the request asked, ``logprobs``);
    ``observed``: rows of observation routes (0: none), shaped as ``routes``' rows."""
    ids = list(range(100 + s.num_tokens, 100 + s.num_tokens + n)) if ids is None else ids
    k = len(ids)
    width = s.request.sampling.logprobs if top is None else top
    top_ids = (
        (np.array(ids, dtype=np.int32)[:, None] + np.arange(width, dtype=np.int32))
        if width
        else None
    )
    return TokensAppended(
        rollout_id=s.rollout_id,
        seq=s.seq + 1 if seq is None else seq,
        attempt=s.attempt if attempt is None else attempt,
        offset=s.num_tokens if offset is None else offset,
        token_ids=np.array(ids, dtype=np.int32),
        logprobs=-np.arange(1, k + 1, dtype=np.float32) / 10,
        weight_versions=np.full(k, version, dtype=np.int64),
        routed_experts=(np.arange(k * 2 * 2).reshape(k, 2, 2) % 8) if routes else None,
        top_token_ids=top_ids,
        top_logprobs=None
        if top_ids is None
        else -np.arange(1, width + 1, dtype=np.float32)[None, :].repeat(k, 0) / 10,
        observation_routes=(
            (np.arange(observed * 4).reshape(observed, 2, 2) + 3) % 8 if observed else None
        ),
    )


def aborted(
    s: RolloutState, reason: AbortReason = AbortReason.WORKER_LOST, attempt: int | None = None
) -> Aborted:
    return Aborted(
        rollout_id=s.rollout_id,
        seq=s.seq + 1,
        attempt=s.attempt if attempt is None else attempt,
        reason=reason,
    )


def finished(s: RolloutState, reason: FinishReason = FinishReason.LENGTH) -> Finished:
    return Finished(rollout_id=s.rollout_id, seq=s.seq + 1, attempt=s.attempt, finish_reason=reason)


def failed(s: RolloutState, error: str = "boom") -> Failed:
    return Failed(rollout_id=s.rollout_id, seq=s.seq + 1, error=error, attempts=s.attempt)


def cancelled(s: RolloutState) -> Cancelled:
    return Cancelled(rollout_id=s.rollout_id, seq=s.seq + 1, reason="trainer")


# -- episodes -----------------------------------------------------------------------------------


def episode(**kw: Any) -> EpisodeSpec:
    spec: dict[str, Any] = {
        "tool_call_stop_token_ids": (7,),
        "tools": (
            ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),
            ToolSpec(name="edit", effect=ToolEffect.RESTORE),
            ToolSpec(name="send", effect=ToolEffect.RESTART),
        ),
    }
    spec.update(kw)
    return EpisodeSpec(**spec)


def episode_submitted(rid: str = "r1", max_tokens: int = 64, **kw: Any) -> Submitted:
    return Submitted(
        rollout_id=rid,
        seq=1,
        request=RolloutRequest(
            prompt_token_ids=(1, 2, 3),
            sampling=SamplingParams(max_tokens=max_tokens),
            episode=episode(**kw),
        ),
    )


def requested(
    s: RolloutState, name: str = "calc", call_id: str | None = None, **kw: Any
) -> ToolCallRequested:
    cid = call_id or f"c{len(s.calls) + 1}"
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "attempt": s.attempt,
        "offset": s.num_tokens,
        "call_id": cid,
        "name": name,
        "arguments": '{"x": 1}',
        "idempotency_key": f"{s.rollout_id}/{cid}",
    }
    fields.update(kw)
    return ToolCallRequested(**fields)


def _pending_id(s: RolloutState) -> str:
    call = s.pending_call
    return call.call_id if call is not None else "c?"


def _live_claim(s: RolloutState) -> int:
    call = s.pending_call
    return call.live_claim if call is not None and call.live_claim else 1


def claimed(s: RolloutState, runner: str = "env1", **kw: Any) -> ToolCallClaimed:
    call = s.pending_call
    last = call.claims[-1].claim if call is not None and call.claims else 0
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "call_id": _pending_id(s),
        "runner_id": runner,
        "claim": last + 1,
    }
    fields.update(kw)
    return ToolCallClaimed(**fields)


def result(s: RolloutState, n: int = 3, seconds: float = 0.5, **kw: Any) -> ToolResultRecorded:
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "call_id": _pending_id(s),
        "claim": _live_claim(s),
        "observation_token_ids": np.arange(900, 900 + n, dtype=np.int32),
        "env_handle": "sandbox-1",
        "env_revision": f"rev-{len(s.calls)}",
        "seconds": seconds,
    }
    fields.update(kw)
    return ToolResultRecorded(**fields)


def harness_submitted(rid: str = "r1", max_tokens: int = 64, **kw: Any) -> Submitted:
    """A harness-driven episode (``EpisodeSpec.harness``): its turns are a harness's calls."""
    return Submitted(
        rollout_id=rid,
        seq=1,
        request=RolloutRequest(
            prompt_token_ids=(1, 2, 3),
            sampling=SamplingParams(max_tokens=max_tokens),
            episode=EpisodeSpec(harness=True, **kw),
        ),
    )


def turn_requested(s: RolloutState, n: int = 3, max_tokens: int = 16, **kw: Any) -> TurnRequested:
    """The harness's next call on ``s`` (awaiting its next turn): ``n`` observation tokens."""
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "call_id": _pending_id(s),
        "call_batch": f"call-{len(s.calls) + 1}",
        "observation_token_ids": np.arange(900, 900 + n, dtype=np.int32),
        "sampling": SamplingParams(max_tokens=max_tokens),
    }
    fields.update(kw)
    return TurnRequested(**fields)


def call_failed(
    s: RolloutState, failure: ToolFailure = ToolFailure.ENV_ERROR, **kw: Any
) -> ToolCallFailed:
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "call_id": _pending_id(s),
        "claim": _live_claim(s),
        "failure": failure,
        "error": "sandbox timed out",
    }
    fields.update(kw)
    return ToolCallFailed(**fields)


def call_lost(s: RolloutState, **kw: Any) -> ToolCallLost:
    call = s.pending_call
    decision = (
        s.request.episode.effect_of(call.name)
        if call is not None and s.request.episode is not None
        else ToolEffect.RESTART
    )
    fields: dict[str, Any] = {
        "rollout_id": s.rollout_id,
        "seq": s.seq + 1,
        "call_id": _pending_id(s),
        "claim": _live_claim(s),
        "decision": decision,
        "detail": "lease expired",
    }
    fields.update(kw)
    return ToolCallLost(**fields)


def budget_finished(s: RolloutState, reason: FinishReason = FinishReason.MAX_TURNS) -> Finished:
    """A Finished written between an episode's turns: no attempt runs, so it names attempt 0."""
    return Finished(rollout_id=s.rollout_id, seq=s.seq + 1, attempt=0, finish_reason=reason)
