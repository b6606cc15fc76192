"""Turning an engine's chunk stream into one result, for tests that want the whole thing.

The worker consumes chunks one by one (it checkpoints as it goes); tests want the
concatenation (`workers.engines.base.join_chunks`), with per-token weight versions kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from statemachine.status import FinishReason
from workers.engines.base import Chunk, Engine, EngineRequest, join_chunks


@dataclass(frozen=True, slots=True)
class Generation:
    """Everything one stream produced, concatenated (arrays as in `Chunk`)."""

    token_ids: list[int]
    logprobs: np.ndarray
    routed_experts: np.ndarray | None
    weight_versions: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    chunks: tuple[Chunk, ...]


def merge_chunks(chunks: Sequence[Chunk]) -> Generation:
    if not chunks:
        return Generation(
            token_ids=[],
            logprobs=np.zeros(0, dtype=np.float32),
            routed_experts=None,
            weight_versions=[],
            finish_reason=None,
            stop_reason=None,
            chunks=(),
        )
    joined = join_chunks(chunks)
    return Generation(
        token_ids=joined.token_ids.tolist(),
        logprobs=joined.logprobs,
        routed_experts=joined.routed_experts,
        weight_versions=joined.weight_versions.tolist(),
        finish_reason=chunks[-1].finish_reason,
        stop_reason=chunks[-1].stop_reason,
        chunks=tuple(chunks),
    )


async def collect_request(engine: Engine, request: EngineRequest) -> Generation:
    """Run `request` to its end (RequestAborted and engine errors propagate)."""
    return merge_chunks([chunk async for chunk in engine.generate(request)])
