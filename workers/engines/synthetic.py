"""An engine with no model: it yields deterministic tokens as fast as the caller takes them.

It measures the ceiling of the worker's own bookkeeping (``bench/bench_overhead.py``) and
drives worker tests that are about the worker, not the model.

It is resume-exact, like a greedy real model: token ``i`` of a rollout depends only on the
original prompt and the absolute position ``i`` in the response. Token ``i`` is
``(sum(prompt) + i) % vocab``, its logprob ``-(i % 7) / 10`` and, with ``experts`` set, its
routed experts ``(i + [0 .. layers * top_k)) % experts`` as ``[layers, top_k]``. A resumed
request (``resumed_tokens=k``: the last ``k`` prompt ids are the rollout's own output) is
continued from position ``k`` of the original prompt, so an aborted and resumed rollout holds
exactly the tokens, logprobs and routes of an uninterrupted run. A request with
``logprobs=k`` gets as its top-k at each position the tokens ``token + j`` (j < k, modulo the
vocabulary) with logprobs ``logprob - j / 2``: the sampled token first, as greedy sampling has it.

Its limits (``limits``) are its ``vocab`` and ``context_length`` (None: unlimited); the
worker checks requests against them as against a real model's (``inflight.check_request``).
Two knobs fail requests on purpose: ``poison_token`` (a prompt holding it raises EngineError,
an engine failure the worker retries within its budget) and ``reject_rollouts`` (requests of
these rollout ids raise RequestRejected: the worker's request ids are ``<rollout id>#<attempt>``;
it picks one sample of a group, whose samples share their prompt).

Besides ``generate`` it is a ``StepEngine`` (``add``/``steps``): every request added is
advanced by one chunk per step, all in one set of numpy operations, so that the GPU-cadence
benchmark (``bench/bench_overhead.py``, ``gpu_cadence_*``) measures the worker, not this
engine. Both paths give a request exactly the same tokens, logprobs and routes.

``sampling.stop_token_ids`` end a stream with its first stop token (``stop``, the token
kept), not before ``min_tokens``; stop strings are not seen (it has no tokenizer). An episode's
tool-call stop token thus ends a turn deterministically: with ``vocab`` V, within V tokens.

``script`` (token ids) replaces that sequence: token ``i`` is ``script[i % len(script)]``,
whatever the prompt (logprobs and routes as above), so a test can have it say a given text,
e.g. a tool call in a chat template's syntax; still resume-exact, stop token ids included.

``token_delay_s`` paces it (seconds per token, slept once per chunk), so that process tests
can kill or stop a worker mid-generation; ``rollouts worker --engine synthetic`` reads its
options from ``$ROLLOUTS_SYNTHETIC_ENGINE`` (``workers.engine_factory``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable, Sequence

import numpy as np

from statemachine import FinishReason
from workers.engines.base import Chunk, End, EngineLimits, EngineRequest, Step, expert_dtype
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
        script: Sequence[int] = (),
    ) -> None:
        self._weight_version = weight_version
        self.vocab = vocab
        self.tokens_per_chunk = tokens_per_chunk
        self.experts, self.layers, self.top_k = experts, layers, top_k
        self.poison_token = poison_token  # a prompt containing it makes generate raise
        self.token_delay_s = token_delay_s
        self.context_length = context_length
        self.reject_rollouts = frozenset(reject_rollouts)
        if any(not 0 <= int(t) < vocab for t in script):
            raise ValueError(f"script: every token id must be in [0, {vocab})")
        self._script = np.asarray(script, dtype=np.int64) if len(script) else None
        self._aborted: set[str] = set()
        self._stops: dict[str, int] = {}  # request id -> the stop token id its stream ends at
        self._closed = False
        # Requests added with ``add``, as parallel arrays (one step is a few numpy operations
        # over all of them): id, sum of the original prompt, next position, end position.
        self._ids: list[str] = []
        self._base = np.empty(0, dtype=np.int64)
        self._done = np.empty(0, dtype=np.int64)
        self._end = np.empty(0, dtype=np.int64)
        self._ends: dict[str, End] = {}  # aborted since the last step, reported by the next
        self._asks: dict[str, int] = {}  # requests added with ``add`` that asked for top-k
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
        shape = f"synthetic:vocab{self.vocab}-experts{self.experts}x{self.layers}x{self.top_k}"
        if self._script is None:
            return shape
        return f"{shape}-script{hashlib.sha256(self._script.tobytes()).hexdigest()[:12]}"

    def _tokens(self, bases: np.ndarray | int, positions: np.ndarray) -> np.ndarray:
        """The tokens at ``positions`` of rollouts whose original prompts sum to ``bases``."""
        if self._script is not None:
            ids: np.ndarray = self._script[positions % len(self._script)]
        else:
            ids = (bases + positions) % self.vocab
        return ids.astype(np.int32)

    def _stop_at(self, base: int, first: int, stop: int) -> int | None:
        """The first position from ``first`` whose token is ``stop`` (None: never)."""
        if self._script is None:
            return first + (stop - base - first) % self.vocab
        at = np.flatnonzero(self._script == stop)
        n = len(self._script)
        return min((first + (int(j) - first) % n for j in at), default=None)

    def _admit(self, request: EngineRequest) -> tuple[int, int, int]:
        """The checks both paths make; the request's prompt sum, first and end positions."""
        if self._closed:
            raise EngineClosed("engine is closed")
        check_request(request, self.limits, context_name="context_length")
        if self.poison_token is not None and self.poison_token in request.prompt_token_ids:
            raise EngineError(f"poison token {self.poison_token} in prompt")
        if request.request_id.partition("#")[0] in self.reject_rollouts:
            raise RequestRejected(f"request {request.request_id!r} is on the reject list")
        prompt, k = request.prompt_token_ids, request.resumed_tokens
        # A resume continues the original prompt's sequence at absolute position k.
        base, end = sum(prompt[: len(prompt) - k]), k + request.sampling.max_tokens
        # Its tokens are known in advance, so is where a stop token id first comes (not before
        # min_tokens, as vLLM masks stops): the stream ends right after it, with it.
        first = k + request.sampling.min_tokens
        at = [self._stop_at(base, first, t) for t in request.sampling.stop_token_ids]
        stop = min((p for p in at if p is not None), default=end)
        if stop < end:
            self._stops[request.request_id] = int(self._tokens(base, np.array([stop]))[0])
            end = stop + 1
        return base, k, end

    def _end_of(self, request_id: str) -> End:
        """How a request's stream that reached its end ends: at its stop token, or by length."""
        stop = self._stops.pop(request_id, None)
        if stop is None:
            return End(finish_reason=FinishReason.LENGTH)
        return End(finish_reason=FinishReason.STOP, stop_reason=stop)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        base, done, end = self._admit(request)
        while done < end:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * min(self.tokens_per_chunk, end - done))
            else:
                await asyncio.sleep(0)  # yield to the loop like a real engine's stream would
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                self._stops.pop(request.request_id, None)
                raise RequestAborted(request.request_id)
            n = min(self.tokens_per_chunk, end - done)
            first = done
            done += n
            routes = None
            if self._routes is not None:
                at = first % self.experts
                routes = self._routes[at : at + n].copy()
            at = first % LOGPROB_PERIOD
            ids = self._tokens(base, np.arange(first, done))
            logprobs = self._logprobs[at : at + n].copy()
            top_ids, top_lps = self._top(ids, logprobs, request.sampling.logprobs)
            last = self._end_of(request.request_id) if done == end else End()
            yield Chunk(
                token_ids=ids,
                logprobs=logprobs,
                routed_experts=routes,
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                weight_version=self._weight_version,
                top_token_ids=top_ids,
                top_logprobs=top_lps,
            )

    def _top(
        self, ids: np.ndarray, logprobs: np.ndarray, k: int
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Top-k arrays [n, k] for sampled ``ids`` (see the module docstring); None if k is 0."""
        if not k:
            return None, None
        j = np.arange(k)
        top_ids = ((ids[:, None].astype(np.int64) + j) % self.vocab).astype(np.int32)
        return top_ids, (logprobs[:, None] - j / 2).astype(np.float32)

    async def add(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self._aborted:
            # Aborted before it came (the worker stopped an attempt it was opening).
            self._aborted.discard(rid)
            raise RequestAborted(rid)
        base, done, end = self._admit(request)
        if rid in self._ids:
            raise EngineError(f"request id {rid!r} is already in flight")
        self._ids = [*self._ids, rid]  # a new list: a step handed out keeps its own
        if request.sampling.logprobs:
            self._asks[rid] = request.sampling.logprobs
        self._base = np.append(self._base, base)
        self._done = np.append(self._done, done)
        self._end = np.append(self._end, end)

    async def steps(self) -> AsyncIterator[Step]:
        while self._ids or self._ends:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * self.tokens_per_chunk)
            else:
                await asyncio.sleep(0)  # one step per loop iteration, like a real engine
            yield self._step()

    def _step(self) -> Step:
        ids, base, done, end = self._ids, self._base, self._done, self._end
        n = np.minimum(self.tokens_per_chunk, end - done)
        if self.tokens_per_chunk == 1:
            counts, positions, bases = None, done, base
        else:
            counts = n
            starts = np.cumsum(n) - n
            positions = np.repeat(done - starts, n) + np.arange(int(n.sum()))
            bases = np.repeat(base, n)
        routes = None
        if self._routes is not None:
            routes = self._routes[positions % self.experts]
        ends, self._ends = self._ends, {}
        token_ids = self._tokens(bases, positions)
        logprobs = self._logprobs[positions % LOGPROB_PERIOD]
        # Only when some request asked: the widest k for all rows (each takes its first k).
        top_ids, top_lps = self._top(token_ids, logprobs, max(self._asks.values(), default=0))
        step = Step(
            request_ids=ids,
            counts=counts,
            token_ids=token_ids,
            logprobs=logprobs,
            routed_experts=routes,
            weight_version=self._weight_version,
            ends=ends,
            top_token_ids=top_ids,
            top_logprobs=top_lps,
        )
        self._done = done = done + n
        finished = done >= end
        if finished.any():
            for i in np.flatnonzero(finished).tolist():
                ends[ids[i]] = self._end_of(ids[i])
            self._drop(~finished)
        return step

    def _drop(self, keep: np.ndarray) -> None:
        if self._asks:
            for rid, k in zip(self._ids, keep.tolist(), strict=True):
                if not k:
                    self._asks.pop(rid, None)
        self._ids = [rid for rid, k in zip(self._ids, keep.tolist(), strict=True) if k]
        self._base, self._done, self._end = self._base[keep], self._done[keep], self._end[keep]

    async def abort(self, request_id: str) -> None:
        if request_id in self._ids:
            self._drop(np.array([rid != request_id for rid in self._ids], dtype=bool))
            self._ends[request_id] = End(error=RequestAborted(request_id))
            self._stops.pop(request_id, None)
            return
        self._aborted.add(request_id)

    async def load_weights(self, source: str, version: int) -> None:
        self._weight_version = version

    async def close(self) -> None:
        self._closed = True
