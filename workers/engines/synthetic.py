"""An engine with no model: it yields deterministic tokens as fast as the caller takes them.

It measures the ceiling of the worker's own bookkeeping (``bench/bench_overhead.py``) and
drives worker tests that are about the worker, not the model. Token ``i`` of a request is
``(sum(prompt) + i) % vocab``; its logprob is ``-(i % 7) / 10``; with ``experts`` set, each
token carries ``[layers, top_k]`` routed experts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from statemachine import FinishReason
from workers.engines.base import Chunk, EngineRequest, expert_dtype
from workers.engines.errors import EngineClosed, EngineError, RequestAborted


class SyntheticEngine:
    def __init__(
        self,
        *,
        weight_version: int = 0,
        vocab: int = 32_000,
        tokens_per_chunk: int = 16,
        experts: int = 0,
        layers: int = 2,
        top_k: int = 2,
        poison_token: int | None = None,
    ) -> None:
        self._weight_version = weight_version
        self.vocab = vocab
        self.tokens_per_chunk = tokens_per_chunk
        self.experts, self.layers, self.top_k = experts, layers, top_k
        self.poison_token = poison_token  # a prompt containing it makes generate raise
        self._aborted: set[str] = set()
        self._closed = False
        # Per-token values repeat (routes with period `experts`, logprobs with period 7):
        # precomputed, so a chunk costs a slice and a copy and the benchmark's ceiling measures
        # the worker, not this engine.
        span = np.arange(max(experts, 7) + tokens_per_chunk)
        self._logprobs = (-(span % 7) / 10).astype(np.float32)
        self._routes = (
            (span[:, None, None] + np.arange(layers * top_k).reshape(1, layers, top_k)) % experts
        ).astype(expert_dtype(experts)) if experts else None  # fmt: skip

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def model_id(self) -> str:
        # Its "model" is the shape of what it emits: two synthetic engines that would give a
        # rollout different tokens or routes are different models.
        return f"synthetic:vocab{self.vocab}-experts{self.experts}x{self.layers}x{self.top_k}"

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        if self._closed:
            raise EngineClosed("engine is closed")
        if self.poison_token is not None and self.poison_token in request.prompt_token_ids:
            raise EngineError(f"poison token {self.poison_token} in prompt")
        base = sum(request.prompt_token_ids)
        total = request.sampling.max_tokens
        done = 0
        while done < total:
            await asyncio.sleep(0)  # yield to the loop like a real engine's stream would
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                raise RequestAborted(request.request_id)
            n = min(self.tokens_per_chunk, total - done)
            first = done
            done += n
            routes = None
            if self._routes is not None:
                at = first % self.experts
                routes = self._routes[at : at + n].copy()
            at = first % 7
            yield Chunk(
                token_ids=((base + np.arange(first, done)) % self.vocab).astype(np.int32),
                logprobs=self._logprobs[at : at + n].copy(),
                routed_experts=routes,
                finish_reason=FinishReason.LENGTH if done == total else None,
                weight_version=self._weight_version,
            )

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def load_weights(self, source: str, version: int) -> None:
        self._weight_version = version

    async def close(self) -> None:
        self._closed = True
