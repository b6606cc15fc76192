"""Weight swaps under in-flight requests, written once for both vLLM engines.

The protocol asks that requests in flight go on across a weight load. Both engines do inside
themselves what the worker does across processes:
- `load_weights` refuses a checkpoint of another architecture before touching anything, then
  closes the gate (no new submission), waits until the submissions already on their way are
  registered by vLLM (one registered after the pause would run on the new weights under the
  old version tag), moves the epoch on, and runs the engine's swap: pause vLLM with
  `mode="abort"` (every running sub-request ends at a step boundary), reload in place, reset
  the prefix cache, resume;
- `generate` runs a request as a series of sub-requests. One that ends with "abort" while the
  epoch moved or the gate is closed was interrupted by a load: the request waits for the gate
  and resubmits `prompt + tokens so far` with its budgets reduced (`translate.continuation`)
  under the new version, so a chunk never spans a swap. An "abort" that no load explains was
  vLLM's own: the stream raises RequestAborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from workers.engines.base import Chunk, EngineRequest
from workers.engines.errors import RequestAborted, WeightLoadError
from workers.engines.identity import config_identity
from workers.engines.inflight import InFlightEngine, Stream

# config.json keys that must match for an in-place reload: a checkpoint that differs in any
# of them does not fit the loaded model (vLLM would fail half-way, or silently mis-load).
_ARCH_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        # Missing directory, missing file or broken JSON: not a checkpoint we can load.
        raise WeightLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightLoadError(f"{path} is not a JSON object")
    return data


def check_same_architecture(current: dict[str, Any], source: str | Path) -> None:
    """Refuse a checkpoint whose architecture differs from the loaded model's, before any
    weight is touched (an in-place reload of another shape fails half-way through)."""
    new = read_config(source)
    diff = {k: (current.get(k), new.get(k)) for k in _ARCH_KEYS if current.get(k) != new.get(k)}
    if diff:
        raise WeightLoadError(f"checkpoint {source} has another architecture: {diff}")
    if not any(Path(source).glob("*.safetensors")):
        raise WeightLoadError(f"checkpoint {source} has no *.safetensors file")


class SwapGate:
    """Closed while a load runs; counts loads (the epoch) and submissions on their way."""

    def __init__(self) -> None:
        self.epoch = 0  # +1 per load: a sub-request submitted before it was interrupted by it
        self._open = asyncio.Event()
        self._open.set()
        self._submitting = 0
        self._lock = asyncio.Lock()

    def current(self, epoch: int) -> bool:
        """No load began since `epoch` was read, and none is running."""
        return self.epoch == epoch and self._open.is_set()

    async def wait_open(self, wake: asyncio.Event | None = None) -> None:
        """Until no load runs, or until `wake` is set (the request was aborted meanwhile)."""
        while not self._open.is_set():
            if wake is None:
                await self._open.wait()
                continue
            waiters = [
                asyncio.ensure_future(self._open.wait()),
                asyncio.ensure_future(wake.wait()),
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if wake.is_set():
                return

    @contextlib.contextmanager
    def submitting(self) -> Iterator[Callable[[], None]]:
        """A submission on its way; a load waits for it to be registered. The block calls
        what it is given once vLLM runs the request, or leaves the block."""
        pending = True

        def running() -> None:
            nonlocal pending
            if pending:
                pending = False
                self._submitting -= 1

        self._submitting += 1
        try:
            yield running
        finally:
            running()

    @contextlib.asynccontextmanager
    async def swap(self) -> AsyncIterator[None]:
        """One load at a time: the gate stays closed for the block, under a new epoch."""
        async with self._lock:
            self._open.clear()
            try:
                while self._submitting:
                    await asyncio.sleep(0.001)  # a submission on its way would miss the pause
                self.epoch += 1
                yield
            finally:
                self._open.set()


@dataclass(eq=False)
class SubRequest(Stream):
    """A request as a vLLM engine runs it: one sub-request after another (see the module)."""

    request: EngineRequest
    sub_id: str | None = None  # the current sub-request's id in vLLM
    wake: asyncio.Event | None = None  # set by abort(), for an engine that waits on it


R = TypeVar("R", bound=SubRequest)


class SwappingEngine(InFlightEngine[R]):
    """Base of the two vLLM engines: `generate` and `load_weights` as the module says; each
    engine submits (`_attempt`) and reloads (`_swap`) its own way."""

    def __init__(
        self, *, weight_version: int, source: str | None, config: dict[str, Any] | None
    ) -> None:
        super().__init__(
            weight_version=weight_version,
            source=source,
            model_id="" if config is None else config_identity(config),
        )
        self._config = config  # the model's config.json; None if unknown (vllm-http)
        self._gate = SwapGate()

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        self._check(request)
        stream = self._new_stream(request)
        self._track(request.request_id, stream)
        generated: list[int] = []
        failures = 0
        finished = False
        try:
            while not finished:
                await self._gate.wait_open(stream.wake)
                if stream.aborted:
                    raise RequestAborted(f"request {request.request_id!r} was aborted")
                epoch, version = self._gate.epoch, self._weight_version
                try:
                    async for chunk in self._attempt(stream, generated, version, epoch):
                        generated.extend(int(t) for t in chunk.token_ids)
                        finished = chunk.finish_reason is not None
                        yield chunk
                except Exception as exc:
                    failures += 1
                    if not await self._retry(stream, exc, failures):
                        raise
                    continue  # resubmit prompt + tokens so far
                if not finished and self._gate.current(epoch):
                    # Ended with "abort" that no load of ours caused (vLLM-side abort).
                    raise RequestAborted(f"request {request.request_id!r} was aborted by vLLM")
        finally:
            self._untrack(request.request_id, stream)
            if not finished:
                await self._abandon(stream)

    async def load_weights(self, source: str, version: int) -> None:
        self._raise_if_closed()
        if self._config is not None:
            check_same_architecture(self._config, source)
        async with self._gate.swap():
            await self._swap(str(source), version)

    # ---- what each engine does its own way --------------------------------------------

    def _check(self, request: EngineRequest) -> None:
        """Refuse a request before anything is submitted (`_check_new`, `check_prompt`)."""
        raise NotImplementedError

    def _new_stream(self, request: EngineRequest) -> R:
        raise NotImplementedError

    def _attempt(
        self, stream: R, generated: list[int], version: int, epoch: int
    ) -> AsyncIterator[Chunk]:
        """One sub-request for `request + generated` under weights `version`: its chunks;
        ends quietly on a finish, or on an "abort" (a load's, or vLLM's own)."""
        raise NotImplementedError

    async def _retry(self, stream: R, exc: Exception, failures: int) -> bool:
        """Whether to resubmit after `_attempt` raised `exc` (the `failures`-th time); may
        raise instead. By default an error ends the stream."""
        return False

    async def _abandon(self, stream: R) -> None:
        """Clean up after a stream that ended without a finish (aborted, failed, left)."""

    async def _swap(self, source: str, version: int) -> None:
        """Pause, reload `source` in place, reset the prefix cache, resume; on success the
        engine reports `source` and `version`. Runs with the gate closed."""
        raise NotImplementedError
