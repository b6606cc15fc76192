"""Builders for requests and events, so tests say only what matters to them."""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine import (
    Aborted,
    AbortReason,
    Cancelled,
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
) -> TokensAppended:
    """``top``: the width of top-k arrays (default: what the request asked, ``logprobs``)."""
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
