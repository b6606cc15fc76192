"""Turning an engine's chunk stream into one result: for callers that want the whole thing.

The worker consumes chunks one by one (it checkpoints as it goes); benchmarks, tests and
direct generation want the concatenation, with per-token weight versions kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from statemachine.status import FinishReason
from workers.engines.base import Chunk, Engine, EngineRequest


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
    routed = [c.routed_experts for c in chunks if c.routed_experts is not None]
    last = chunks[-1] if chunks else None
    return Generation(
        token_ids=[int(t) for c in chunks for t in c.token_ids],
        logprobs=(
            np.concatenate([c.logprobs for c in chunks])
            if chunks
            else np.zeros(0, dtype=np.float32)
        ),
        routed_experts=np.concatenate(routed) if routed else None,
        weight_versions=[c.weight_version for c in chunks for _ in range(len(c.token_ids))],
        finish_reason=last.finish_reason if last else None,
        stop_reason=last.stop_reason if last else None,
        chunks=tuple(chunks),
    )


async def collect_request(engine: Engine, request: EngineRequest) -> Generation:
    """Run `request` to its end (RequestAborted and engine errors propagate)."""
    return merge_chunks([chunk async for chunk in engine.generate(request)])
