"""A CPU engine on transformers + torch, for tests, demos and the tiny models.

One background thread owns the model and runs a decode loop over every request in flight,
one decode step per request per round (round-robin interleaving, each request with its own
KV cache). The asyncio side only queues work and receives chunks, so the event loop stays
responsive while the model computes.

Why interleaving and not padded batched decoding: interleaved steps are exactly the
computation a request would get alone, so "same greedy tokens and bit-identical logprobs
whatever else is in flight" holds by construction; a padded batch changes the matmul shapes
and the attention mask, hence the float rounding. What that costs, measured on this 2-core
machine (shared, so +-30% run to run) with the tiny MoE model, transformers 5.24, torch 2.13:
raw one-token forwards give 320-540 tok/s for one sequence and 1100-1980 tok/s for a batch of
4 (3.5-4.8x, Python overhead dominates at this size); this engine gives 210-360 tok/s with 1
request in flight and 280-320 tok/s with 4 (interleaving keeps the total constant). The
engine is a correctness reference and a test double; vLLM batches for real.

Chunking: one chunk per sampled token (per decode step), carrying the weight version that
sampled it.

Abort: `abort` marks the stream aborted on the event loop at once (anything already queued
for it is dropped and its iterator raises RequestAborted); the decode thread forgets the
request at its next round, at most one decode step per other request later.

Weight updates: `load_weights` is applied by the decode thread between two rounds (a safe
point: no forward is running). Every in-flight request's KV cache, computed under the old
weights, is then dropped and recomputed from prompt + tokens generated so far on the new
weights before its next token is sampled; tokens after the swap carry the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.engines.base import Chunk, EngineRequest
from workers.engines.cpu_model import CpuModel
from workers.engines.sampling import banned_tokens, sample, step_seed
from workers.engines.stopping import StopChecker
from workers.errors import EngineClosed, EngineError, RequestAborted, WorkerError

# Prompt tokens fed per request per round: bounds how long one new request's prefill delays
# the others' decode steps, an abort, or a weight load (~2.5 ms per token on the tiny MoE).
PREFILL_TOKENS_PER_ROUND = 64

Deliver = Callable[[Any], None]


@dataclass(eq=False)
class _Seq:
    """Decode-thread state of one request."""

    serial: int
    request: EngineRequest
    deliver: Deliver
    stop: StopChecker
    base_seed: int
    tokens: list[int]
    n_prompt: int
    cache: Any = None
    n_cached: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)


@dataclass(eq=False)
class _Load:
    source: str
    version: int
    deliver: Deliver


@dataclass(eq=False)
class _Stream:
    """Event-loop side of one request: its queue and whether it was aborted."""

    serial: int
    queue: asyncio.Queue[Any]
    aborted: bool = False


_END = object()  # queued to wake a consumer whose request was aborted


class CpuEngine:
    """`Engine` on a local Hugging Face model directory (see the module docstring)."""

    def __init__(
        self, model_dir: str | Path, *, weight_version: int = 0, threads: int | None = None
    ) -> None:
        # torch's intra-op pool spins on every core it owns; sharing those cores with the
        # worker's event loop and Redis client made every decode step wait on a descheduled
        # thread (measured: durable/direct fell to ~0.7 with all cores, bench_overhead.py).
        # Leave one core to the rest of the process by default.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
        self._model = CpuModel(model_dir)
        self._weight_version = weight_version
        self._serials = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._cond = threading.Condition()
        self._new: list[_Seq] = []  # guarded by _cond
        self._loads: list[_Load] = []  # guarded by _cond
        self._aborts: set[int] = set()  # serials; guarded by _cond
        self._closing = False
        self._active: list[_Seq] = []  # decode thread only
        self._thread = threading.Thread(target=self._run, name="cpu-engine", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def tokenizer(self) -> Any:
        return self._model.tokenizer

    # ---- event-loop side -------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        self._check_request(request)
        loop = asyncio.get_running_loop()
        stream = _Stream(serial=next(self._serials), queue=asyncio.Queue())
        self._streams[request.request_id] = stream

        def deliver(item: Any) -> None:
            _post(loop, stream.queue.put_nowait, item)

        self._submit(self._new_seq(stream.serial, request, deliver))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if stream.aborted:
                    # Late outputs after abort() are dropped, whatever was already queued.
                    raise RequestAborted(f"request {request.request_id!r} was aborted")
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if self._streams.get(request.request_id) is stream:
                del self._streams[request.request_id]
            if not finished:
                # Aborted, or the consumer stopped iterating: free the decode slot.
                self._abort_serial(stream.serial)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # unknown, finished or already aborted: abort is idempotent
        stream.aborted = True
        stream.queue.put_nowait(_END)
        self._abort_serial(stream.serial)

    async def load_weights(self, source: str, version: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def deliver(result: Any) -> None:
            _post(loop, _settle, done, result)

        with self._cond:
            if self._closing:
                raise EngineClosed("engine is closed")
            self._loads.append(_Load(source=str(source), version=version, deliver=deliver))
            self._cond.notify()
        await done

    async def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- helpers shared by both sides ------------------------------------------------

    def _check_request(self, request: EngineRequest) -> None:
        if self._closing:
            raise EngineClosed("engine is closed")
        if request.request_id in self._streams:
            raise EngineError(f"request id {request.request_id!r} is already in flight")
        ids = request.prompt_token_ids
        if not ids:
            raise EngineError("prompt_token_ids must not be empty")
        bad = [t for t in ids if not 0 <= t < self._model.vocab_size]
        if bad:
            raise EngineError(
                f"prompt token ids outside the vocabulary (size {self._model.vocab_size}): "
                f"{bad[:5]}"
            )
        if len(ids) >= self._model.max_positions:
            raise EngineError(
                f"prompt of {len(ids)} tokens leaves no room within "
                f"max_position_embeddings={self._model.max_positions}"
            )

    def _new_seq(self, serial: int, request: EngineRequest, deliver: Deliver) -> _Seq:
        sampling = request.sampling
        stop = StopChecker(
            sampling,
            eos_token_ids=self._model.eos_token_ids,
            decode=self._model.decode,
            max_total_tokens=self._model.max_positions,
            prior=request.prompt_token_ids[len(request.prompt_token_ids) - request.resumed_tokens :]
            if request.resumed_tokens
            else (),
        )
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        tokens = list(request.prompt_token_ids)
        return _Seq(serial, request, deliver, stop, seed, tokens, n_prompt=len(tokens))

    def _submit(self, seq: _Seq) -> None:
        with self._cond:
            self._new.append(seq)
            self._cond.notify()

    def _abort_serial(self, serial: int) -> None:
        with self._cond:
            self._aborts.add(serial)
            self._cond.notify()

    # ---- decode thread ---------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while self._round():
                pass
        for seq in self._active:
            seq.deliver(EngineClosed("engine closed while the request was in flight"))
        for load in self._loads:
            load.deliver(EngineClosed("engine closed before the weights were loaded"))

    def _round(self) -> bool:
        """One scheduling round: take new work, apply aborts and loads, step each request."""
        with self._cond:
            while not (self._new or self._aborts or self._loads or self._active or self._closing):
                self._cond.wait()
            if self._closing:
                self._active.extend(self._new)
                self._new.clear()
                return False
            self._active.extend(self._new)
            self._new.clear()
            aborts, self._aborts = self._aborts, set()
            loads, self._loads = self._loads, []
        self._active = [s for s in self._active if s.serial not in aborts]
        for load in loads:
            self._apply_load(load)
        for seq in list(self._active):
            if seq.serial in self._aborts:
                continue  # aborted during this round; removed at the next one
            try:
                done = self._step(seq)
            except Exception as exc:
                # One request's failure (e.g. a forward error) must not stop the others.
                seq.deliver(EngineError(f"{type(exc).__name__}: {exc}"))
                done = True
            if done:
                self._active.remove(seq)
        return True

    def _apply_load(self, load: _Load) -> None:
        try:
            self._model.swap_weights(load.source)
        except WorkerError as exc:
            # A bad checkpoint fails only the load call; old weights and version stay.
            load.deliver(exc)
            return
        self._weight_version = load.version
        for seq in self._active:
            # KV computed under the old weights is stale: recompute from scratch.
            seq.cache = None
            seq.n_cached = 0
        load.deliver(None)

    def _step(self, seq: _Seq) -> bool:
        """Advance one request by one token (or by a slice of its prefill); True when done."""
        model = self._model
        if seq.cache is None:
            seq.cache = model.new_cache()
        last = len(seq.tokens) - 1
        budget = PREFILL_TOKENS_PER_ROUND
        while seq.n_cached < last and budget > 0:
            model.forward(seq.tokens[seq.n_cached], seq.cache)
            seq.n_cached += 1
            budget -= 1
        if seq.n_cached < last:
            return False
        logits, routing = model.forward(seq.tokens[last], seq.cache)
        seq.n_cached += 1
        generated = seq.tokens[seq.n_prompt :]
        params = seq.request.sampling
        seq.generator.manual_seed(step_seed(seq.base_seed, len(seq.tokens)))
        token, logprob = sample(
            logits,
            params,
            banned=banned_tokens(
                params, n_generated=len(generated), eos_token_ids=model.eos_token_ids
            ),
            generator=seq.generator,
        )
        seq.tokens.append(token)
        finish, stop_reason = seq.stop.check(seq.tokens[seq.n_prompt :], len(seq.tokens))
        seq.deliver(
            Chunk(
                token_ids=np.array([token], dtype=np.int32),
                logprobs=np.array([logprob], dtype=np.float32),
                routed_experts=None if routing is None else routing[np.newaxis],
                finish_reason=finish,
                stop_reason=stop_reason,
                weight_version=self._weight_version,
            )
        )
        return finish is not None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on `loop` from the decode thread."""
    # RuntimeError: the loop is closed, so whoever waited on this output is gone.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[None], result: Any) -> None:
    if future.done():
        return  # the awaiting task was cancelled; nobody wants the outcome
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(None)
