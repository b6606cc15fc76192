"""The `vllm` engine: vLLM's AsyncLLM in this process, behind the Engine protocol.

Token ids in (`TokensPrompt`), token ids out, streamed as DELTA outputs with the raw logprob
of each sampled token (`logprobs=0`, vLLM's default `logprobs_mode="raw_logprobs"`), and with
`logprobs=k` vLLM's top-k of each position too (its flat logprobs: the sampled entry, then k).

Weight updates keep in-flight requests going, as the protocol asks (`swap.py`, shared with
the HTTP engine): `load_weights` pauses vLLM with `mode="abort"` (every running sub-request
ends at a step boundary), reloads the checkpoint in place through the worker extension
(`ext.py`), resets the prefix cache, and each interrupted stream resubmits
`prompt + tokens so far` with its budgets reduced. So
- a chunk never spans a swap, and its `weight_version` is exact (a sub-request lives under
  one version; vLLM's own version labels come only on the final output);
- the KV cache of in-flight requests is recomputed on the new weights, never reused stale;
- `cache_salt` is the weight version too, so a prefix computed under other weights can never
  be hit even if a reset were missed.
The price: a seeded *sampled* (temperature > 0) request restarts its random stream at the
swap (vLLM seeds a generator per request); greedy output is unaffected.

Routed experts (`routed_experts=True`, needs vLLM's `enable_return_routed_experts`, which
needs Model Runner V2 and so Triton: GPU only): vLLM returns them only on a request's final
output, so chunks are then held back until the sub-request ends (one chunk per sub-request,
its rows sliced by `routes_for_tokens`). On CPU the MoE engine yields `routed_experts=None`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.engines.base import Chunk, EngineLimits, EngineRequest, config_expert_dtype
from workers.engines.errors import (
    EngineDead,
    EngineError,
    RequestAborted,
    RequestRejected,
    WeightLoadError,
)
from workers.engines.identity import eos_token_ids
from workers.engines.inflight import check_request
from workers.engines.vllm.ext import EXTENSION, RELOAD_METHOD
from workers.engines.vllm.stepping import SteppedRequest, SteppingVllm
from workers.engines.vllm.swap import SubRequest, read_config
from workers.engines.vllm.translate import (
    ABORT,
    continuation,
    finish_reason,
    flat_top,
    routes_for_tokens,
    stop_reason,
)

log = logging.getLogger("rollouts.vllm")

CPU_KV_CACHE_BYTES = 256 << 20  # 256k tokens of the tiny models; plenty for tests and demos


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """Engine arguments we choose; anything else goes through `extra` to AsyncEngineArgs.

    float32 by default: bfloat16 output depends on batch composition, so the exact
    abort/resume equality (invariant 3) only holds in float32.
    """

    dtype: str = "float32"
    max_model_len: int = 2048
    enforce_eager: bool = True
    seed: int = 0
    # KV cache size. None: vLLM's own sizing on GPU (gpu_memory_utilization), and on CPU
    # CPU_KV_CACHE_BYTES instead of vLLM's 4 GiB per engine.
    kv_cache_bytes: int | None = None
    routed_experts: bool = False
    # vLLM's stream_interval: tokens per streamed output. Larger chunks mean fewer consumer
    # iterations, but measured with bench_vllm.py (tiny MoE, 64 x 128 tokens, 16 in flight,
    # this shared 2-core machine) durable/direct was 0.73-0.99 with 1 and 0.79-0.83 with 16:
    # no clear gain, so one token per chunk, like the CPU engine. Raise it on fast GPUs.
    stream_interval: int = 1
    extra: tuple[tuple[str, Any], ...] = ()


class VllmEngine(SteppingVllm):
    """`Engine` on an in-process `vllm.v1.engine.async_llm.AsyncLLM`; also a ``StepEngine``
    (``stepping.py``)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        weight_version: int = 0,
        options: VllmOptions | None = None,
    ) -> None:
        # Blocking (~15-25 s on 2 CPU cores): builds the engine core and worker processes.
        # Safe outside an event loop: AsyncLLM starts its output task on first use.
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415  (heavy import)
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        self.options = opts = options or VllmOptions()
        config = read_config(model_dir)
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": opts.dtype,
            "max_model_len": opts.max_model_len,
            "enforce_eager": opts.enforce_eager,
            "seed": opts.seed,
            "worker_extension_cls": EXTENSION,
            "enable_prefix_caching": True,
            "disable_log_stats": True,
            "enable_return_routed_experts": opts.routed_experts,
            **dict(opts.extra),
        }
        if opts.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = opts.kv_cache_bytes
        elif not _has_gpu():
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self._llm: Any = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        super().__init__(weight_version=weight_version, source=str(model_dir), config=config)
        self._vocab = int(config["vocab_size"])
        self._eos = eos_token_ids(model_dir)
        self._expert_dtype = config_expert_dtype(config)
        self._routed = opts.routed_experts
        self._serials = itertools.count()
        self._init_steps()

    # ---- generate ------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(context_length=self.options.max_model_len, vocab_size=self._vocab)

    def _check(self, request: EngineRequest) -> None:
        self._check_new(request.request_id)
        check_request(request, self.limits, context_name="max_model_len")

    def _new_stream(self, request: EngineRequest) -> SubRequest:
        return SubRequest(request=request, wake=asyncio.Event())

    async def _abandon(self, stream: SubRequest) -> None:
        if stream.sub_id is not None and not self._closed:
            # Aborted, failed, or the consumer left: free vLLM's slot (idempotent there).
            with contextlib.suppress(Exception):  # cleanup must not mask the cause
                await self._llm.abort(stream.sub_id)

    async def _submit(self, stream: SubRequest, generated: list[int], version: int) -> Any:
        from vllm import SamplingParams, TokensPrompt  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        prompt, kwargs = continuation(stream.request, generated)
        try:
            params = SamplingParams(
                **kwargs,
                flat_logprobs=True,
                output_kind=RequestOutputKind.DELTA,
                stream_interval=self.options.stream_interval,
                # Text is only needed to match stop strings (callers decode ids themselves),
                # and detokenizing runs on this process's event loop, shared with the worker.
                detokenize=bool(stream.request.sampling.stop),
            )
        except Exception as exc:
            # vLLM's own checks of the sampling values (VLLMValidationError).
            raise _submit_error(exc) from exc
        if self.options.routed_experts:
            # Rows from the last prompt position on: row t is the forward that produced
            # token t (see Chunk), so no prompt rows cross the wire.
            params.routed_experts_prompt_start = len(prompt) - 1
        stream.sub_id = f"{stream.request.request_id}@{next(self._serials)}"
        with self._gate.submitting():
            try:
                return await self._llm.add_request(
                    stream.sub_id,
                    TokensPrompt(prompt_token_ids=prompt, cache_salt=f"w{version}"),
                    params,
                )
            except Exception as exc:
                # vLLM's validation of the request surfaces as RequestRejected, a dead engine
                # as EngineDead, anything else as EngineError.
                raise _submit_error(exc) from exc

    async def _attempt(
        self, stream: SubRequest, generated: list[int], version: int, epoch: int
    ) -> AsyncIterator[Chunk]:
        """Chunks of one sub-request; ends quietly on a finish or on an abort."""
        collector = await self._submit(stream, generated, version)
        held: list[Any] = []  # outputs held back until routes arrive (routed_experts only)
        while True:
            out = await _next_output(collector)
            if stream.aborted:
                # Late outputs after abort() are dropped, whatever was already collected.
                raise RequestAborted(f"request {stream.request.request_id!r} was aborted")
            completion = out.outputs[0]
            interrupted = completion.finish_reason == ABORT
            if interrupted and self._gate.current(epoch):
                return  # an abort nobody asked of this engine: generate() raises
            reason = None if interrupted else finish_reason(completion.finish_reason)
            k = stream.request.sampling.logprobs
            if self.options.routed_experts:
                held.append(completion)
                if reason is None and not interrupted:
                    continue
                chunk = self._routed_chunk(held, reason, version, k)
            else:
                chunk = self._chunk(completion, reason, version, k)
            if chunk is not None and reason is not None:
                chunk = dataclasses.replace(
                    chunk,
                    stop_reason=stop_reason(
                        chunk.stop_reason, params=stream.request.sampling, eos_ids=self._eos
                    ),
                )
            if chunk is not None:
                yield chunk
            if reason is not None or interrupted:
                return

    def _chunk(self, completion: Any, reason: Any, version: int, k: int) -> Chunk | None:
        ids = np.asarray(completion.token_ids, dtype=np.int32)
        if ids.size == 0 and reason is None:
            return None
        return Chunk(
            token_ids=ids,
            logprobs=sampled_logprobs(completion.logprobs, ids),
            finish_reason=reason,
            stop_reason=completion.stop_reason if reason is not None else None,
            weight_version=version,
            **_tops([completion], k),
        )

    def _routed_chunk(self, held: list[Any], reason: Any, version: int, k: int) -> Chunk | None:
        ids = np.asarray([t for c in held for t in c.token_ids], dtype=np.int32)
        if ids.size == 0 and reason is None:
            return None
        logprobs = np.concatenate([sampled_logprobs(c.logprobs, c.token_ids) for c in held])
        assert self._expert_dtype is not None
        last = held[-1]
        return Chunk(
            token_ids=ids,
            logprobs=logprobs.astype(np.float32),
            routed_experts=routes_for_tokens(last.routed_experts, ids.size, self._expert_dtype),
            finish_reason=reason,
            stop_reason=last.stop_reason if reason is not None else None,
            weight_version=version,
            **_tops(held, k),
        )

    # ---- abort, weights, close -------------------------------------------------------

    async def _stop(self, stream: SubRequest) -> None:
        if isinstance(stream, SteppedRequest):
            self._stepped_stop(stream)
        if stream.wake is not None:
            stream.wake.set()
        if stream.sub_id is not None and not self._closed:
            await self._llm.abort(stream.sub_id)

    async def _swap(self, source: str, version: int) -> None:
        await self._llm.pause_generation(mode="abort", clear_cache=True)
        try:
            await self._reload(source)
            self._weight_version = version
        finally:
            # KV and prefix cache from the old weights must never be reused.
            await self._llm.reset_prefix_cache()
            await self._llm.resume_generation()

    async def _reload(self, source: str) -> None:
        errors = await self._llm.collective_rpc(RELOAD_METHOD, args=(source,))
        failed = [e for e in errors if e]
        if not failed:
            self._source = source
            return
        # A failed reload may have overwritten some tensors: put the last good weights back.
        restore = await self._llm.collective_rpc(RELOAD_METHOD, args=(self._source,))
        if any(restore):
            raise EngineError(
                f"reload of {source} failed ({failed[0]}) and so did the "
                f"restore of {self._source} ({restore}); weights are unusable"
            )
        raise WeightLoadError(f"reload of {source} failed: {failed[0]}")

    async def weight_checksum(self) -> float:
        """Sum of all parameters in the worker (tests: did a reload change the weights?)."""
        return float((await self._llm.collective_rpc("durable_weight_checksum"))[0])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._woken.set()  # steps() ends its streams with EngineClosed
        for stream in list(self._streams.values()):
            stream.aborted = True
            if stream.wake is not None:
                stream.wake.set()
        handler = self._llm.output_handler
        if handler is not None:
            # Stopped first, or it reports the engine core's exit below as an engine death.
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await handler  # RuntimeError: the task belongs to a loop that is gone
        # shutdown() blocks (it joins vLLM's processes, a few seconds): off the loop.
        await asyncio.to_thread(self._llm.shutdown)
        # Dropped now, while modules are intact: AsyncLLM.__del__ calls shutdown() again
        # and fails noisily when that happens at interpreter exit.
        self._llm = None


def _tops(completions: list[Any], k: int) -> dict[str, Any]:
    """A chunk's top-k arrays from vLLM's own outputs (``logprobs=k``), or nothing if k is 0."""
    if not k:
        return {}
    tops = [flat_top(c.logprobs, len(c.token_ids), k) for c in completions]
    return {
        "top_token_ids": np.concatenate([ids for ids, _ in tops]),
        "top_logprobs": np.concatenate([lps for _, lps in tops]),
    }


def _has_gpu() -> bool:
    import torch  # noqa: PLC0415  (present wherever vllm is)

    return bool(torch.cuda.is_available())


async def _next_output(collector: Any) -> Any:
    """The collector's next (possibly merged) output; vLLM's failures as EngineError.

    No separate wake-up is needed for abort: `AsyncLLM.abort` puts a final "abort" output
    into the collector before it returns, which ends this wait.
    """
    try:
        return collector.get_nowait() or await collector.get()
    except Exception as exc:
        # EngineDeadError and request-level errors travel through the collector.
        error = _error_type(exc)
        raise error(f"vLLM failed the request: {type(exc).__name__}: {exc}") from exc


def _submit_error(exc: BaseException) -> EngineError:
    """Our error for what vLLM raised while taking a request (``add_request``, or building its
    SamplingParams). vLLM 0.32 validates requests there and raises ``VLLMValidationError``
    (a ``VLLMClientError``: "the request's fault", which its server answers with 400), e.g. for
    a prompt longer than max_model_len or ids outside the vocabulary
    (``v1/engine/input_processor.py``, ``renderers/base.py``) or bad sampling values
    (``sampling_params.py``); plain ValueError/TypeError come from the same checks in places."""
    from vllm.exceptions import VLLMClientError  # noqa: PLC0415

    text = f"vLLM refused the request: {type(exc).__name__}: {exc}"
    error = _error_type(exc)
    if error is EngineError and isinstance(exc, VLLMClientError | ValueError | TypeError):
        return RequestRejected(text)
    return error(text)


def _error_type(exc: BaseException) -> type[EngineError]:
    """EngineDead for vLLM's EngineDeadError (the worker must stop), else EngineError."""
    from vllm.v1.engine.exceptions import EngineDeadError  # noqa: PLC0415

    return EngineDead if isinstance(exc, EngineDeadError) else EngineError


def sampled_logprobs(logprobs: Any, token_ids: Any) -> np.ndarray:
    """The sampled token's logprob per position from vLLM's (flat) logprobs.

    With `logprobs=0` each position holds exactly the sampled token; its entry comes first
    whatever k is (vLLM puts the sampled token ahead of the top-k).
    """
    n = len(token_ids)
    if logprobs is None or len(logprobs) != n:
        raise EngineError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} logprobs for {n} tokens"
        )
    starts = logprobs.start_indices
    values = np.fromiter((logprobs.logprobs[s] for s in starts), dtype=np.float64, count=n)
    ids = [logprobs.token_ids[s] for s in starts]
    if ids != [int(t) for t in token_ids]:
        raise EngineError("vLLM's logprobs are not those of the sampled tokens")
    return values.astype(np.float32)
