"""An engine with no model: it yields deterministic tokens as fast as the caller takes them.

It measures the ceiling of the worker's own bookkeeping (``bench/bench_overhead.py``) and
drives worker tests that are about the worker, not the model.

It is resume-exact, like a greedy real model: token ``i`` of a rollout depends only on the
original prompt and the absolute position ``i`` in the response. Token ``i`` is
``(sum(prompt) + i) % vocab``, its logprob ``-(i % 7) / 10`` and, with ``experts`` set, its
routed experts ``(i + [0 .. layers * top_k)) % experts`` as ``[layers, top_k]``. A resumed
request (``resumed_tokens=k``: the last ``k`` prompt ids are the rollout's own output) is
continued from position ``k`` of the original prompt, so an aborted and resumed rollout holds
exactly the tokens, logprobs and routes of an uninterrupted run.

Its limits (``limits``) are its ``vocab`` and ``context_length`` (None: unlimited); the
worker checks requests against them as against a real model's (``inflight.check_request``).
Two knobs fail requests on purpose: ``poison_token`` (a prompt holding it raises EngineError,
an engine failure the worker retries within its budget) and ``reject_rollouts`` (requests of
these rollout ids raise RequestRejected: the worker's request ids are ``<rollout id>#<attempt>``;
it picks one sample of a group, whose samples share their prompt).

``token_delay_s`` paces it (seconds per token, slept once per chunk), so that process tests
can kill or stop a worker mid-generation; ``rollouts worker --engine synthetic`` reads its
options from ``$ROLLOUTS_SYNTHETIC_ENGINE`` (``workers.engine_factory``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import numpy as np

from statemachine import FinishReason
from workers.engines.base import Chunk, EngineLimits, EngineRequest, expert_dtype
from workers.engines.errors import EngineClosed, EngineError, RequestAborted, RequestRejected
from workers.engines.inflight import check_request

LOGPROB_PERIOD = 7


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
        token_delay_s: float = 0.0,
        context_length: int | None = None,
        reject_rollouts: Iterable[str] = (),
    ) -> None:
        self._weight_version = weight_version
        self.vocab = vocab
        self.tokens_per_chunk = tokens_per_chunk
        self.experts, self.layers, self.top_k = experts, layers, top_k
        self.poison_token = poison_token  # a prompt containing it makes generate raise
        self.token_delay_s = token_delay_s
        self.context_length = context_length
        self.reject_rollouts = frozenset(reject_rollouts)
        self._aborted: set[str] = set()
        self._closed = False
        # Per-token values repeat (routes with period `experts`, logprobs with period 7):
        # precomputed, so a chunk costs a slice and a copy and the benchmark's ceiling measures
        # the worker, not this engine.
        span = np.arange(max(experts, LOGPROB_PERIOD) + tokens_per_chunk)
        self._logprobs = (-(span % LOGPROB_PERIOD) / 10).astype(np.float32)
        self._routes = (
            (span[:, None, None] + np.arange(layers * top_k).reshape(1, layers, top_k)) % experts
        ).astype(expert_dtype(experts)) if experts else None  # fmt: skip

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(context_length=self.context_length, vocab_size=self.vocab)

    @property
    def model_id(self) -> str:
        # Its "model" is the shape of what it emits: two synthetic engines that would give a
        # rollout different tokens or routes are different models.
        return f"synthetic:vocab{self.vocab}-experts{self.experts}x{self.layers}x{self.top_k}"

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        if self._closed:
            raise EngineClosed("engine is closed")
        check_request(request, self.limits, context_name="context_length")
        if self.poison_token is not None and self.poison_token in request.prompt_token_ids:
            raise EngineError(f"poison token {self.poison_token} in prompt")
        if request.request_id.partition("#")[0] in self.reject_rollouts:
            raise RequestRejected(f"request {request.request_id!r} is on the reject list")
        prompt, k = request.prompt_token_ids, request.resumed_tokens
        # A resume continues the original prompt's sequence at absolute position k.
        base = sum(prompt[: len(prompt) - k])
        done, end = k, k + request.sampling.max_tokens
        while done < end:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * min(self.tokens_per_chunk, end - done))
            else:
                await asyncio.sleep(0)  # yield to the loop like a real engine's stream would
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                raise RequestAborted(request.request_id)
            n = min(self.tokens_per_chunk, end - done)
            first = done
            done += n
            routes = None
            if self._routes is not None:
                at = first % self.experts
                routes = self._routes[at : at + n].copy()
            at = first % LOGPROB_PERIOD
            yield Chunk(
                token_ids=((base + np.arange(first, done)) % self.vocab).astype(np.int32),
                logprobs=self._logprobs[at : at + n].copy(),
                routed_experts=routes,
                finish_reason=FinishReason.LENGTH if done == end else None,
                weight_version=self._weight_version,
            )

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def load_weights(self, source: str, version: int) -> None:
        self._weight_version = version

    async def close(self) -> None:
        self._closed = True
