"""The `vllm-http` engine: vLLM servers over HTTP behind the Engine protocol.

Servers: `python -m vllm.entrypoints.launchers.api_server.entry --model DIR
--enable-scale-out --worker-extension-cls workers.engines.vllm.ext.DurableWorkerExtension`
with `VLLM_SERVER_DEV_MODE=1` (pause/resume, collective_rpc and reset_prefix_cache endpoints).

Generation is token-in/token-out (`POST /inference/v1/generate`, streamed as server-sent
events, `logprobs=0`: the raw logprob of each sampled token; with `logprobs=k` the server is
asked for k + 1 and the top-k read from its lists, see `wire.top_k_of`). Requests go to the
least-loaded healthy server (`http_pool.ServerPool`). When a server dies mid-stream, the
tokens already yielded stand and the rest is resubmitted as `prompt + tokens so far` (budgets
reduced) to another server, within the retry budget: callers see one uninterrupted stream,
exact for greedy decoding (invariant 3). When retries run out or no server is healthy the
stream raises `EngineUnavailable`; a 4xx other than 429 raises `HttpStatusError` at once.

Weights: `load_weights` pauses every server (`mode=abort`), reloads in place through the
worker extension, resets the prefix cache and resumes; interrupted streams resubmit under
the new version, so a chunk never spans a swap (`swap.py`, shared with `local.py`). A server
that was down during a load gets the current weights from the prober before it is used again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from workers.engines.base import (
    Chunk,
    EngineLimits,
    EngineRequest,
    config_expert_dtype,
    join_chunks,
    join_tokens,
)
from workers.engines.errors import (
    EngineUnavailable,
    RequestAborted,
    RequestRejected,
    WeightLoadError,
)
from workers.engines.identity import eos_token_ids
from workers.engines.inflight import check_request
from workers.engines.vllm.ext import RELOAD_METHOD
from workers.engines.vllm.http_pool import (
    HttpOptions,
    HttpStatusError,
    Server,
    ServerPool,
    is_retryable,
    marks_unhealthy,
    raise_for_status,
)
from workers.engines.vllm.swap import SubRequest, SwappingEngine, read_config
from workers.engines.vllm.translate import (
    ABORT,
    continuation,
    finish_reason,
    routes_for_tokens,
    stop_reason,
)
from workers.engines.vllm.wire import (
    GenerateResult,
    decode_choice,
    generate_body,
    parse_sse_line,
    server_request_id,
)

# Answers that say the request itself is wrong: never retried, the rollout fails as a
# request error (404, 405: a misconfigured URL, stays an engine error).
REJECTED_STATUSES = frozenset({400, 422})


@dataclass(eq=False)
class _Stream(SubRequest):
    server: Server | None = None
    response: aiohttp.ClientResponse | None = None


class VllmHttpEngine(SwappingEngine[_Stream]):
    """`Engine` over one or more vLLM servers (see the module docstring)."""

    def __init__(
        self,
        urls: list[str],
        *,
        model_dir: str | Path | None = None,
        weight_version: int = 0,
        options: HttpOptions | None = None,
        routed_experts: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        """`model_dir`, when given, is the servers' model: it lets the client refuse bad
        prompts and other-architecture checkpoints locally, and map every eos to stop
        reason None as the protocol asks."""
        self.pool = ServerPool(urls, options, on_recover=self._sync_weights)
        config = read_config(model_dir) if model_dir is not None else None
        # model_id: the servers' model identity, from `model_dir`; "" (unknown: no check
        # against other attempts) without one. `rollouts worker --model-id` can name it instead.
        # source: None until a load, i.e. the weights the servers started with.
        super().__init__(weight_version=weight_version, source=None, config=config)
        self._eos = eos_token_ids(model_dir) if model_dir is not None else frozenset()
        self._max_len = max_model_len
        self._routed = routed_experts
        dtype = None if config is None else config_expert_dtype(config)
        # No config naming the expert count: uint16 (routes_for_tokens refuses larger ids).
        self._expert_dtype = np.dtype(np.uint16) if dtype is None else dtype
        self._serials = itertools.count()

    # ---- generate ------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        # Without the model directory only the servers know; they answer 400 (see _retry).
        if self._config is None:
            return EngineLimits(context_length=self._max_len, vocab_size=None)
        return EngineLimits(
            context_length=self._max_len or int(self._config["max_position_embeddings"]),
            vocab_size=int(self._config["vocab_size"]),
        )

    def _check(self, request: EngineRequest) -> None:
        self._check_new(request.request_id)
        check_request(request, self.limits, context_name="max_model_len")

    def _new_stream(self, request: EngineRequest) -> _Stream:
        return _Stream(request=request)  # no wake: a stream waiting out a load is not woken

    async def _retry(self, stream: _Stream, exc: Exception, failures: int) -> bool:
        request_id = stream.request.request_id
        if stream.aborted:
            raise RequestAborted(f"request {request_id!r} was aborted") from exc
        if isinstance(exc, HttpStatusError) and exc.status in REJECTED_STATUSES:
            # vLLM's server answers a request it refuses (VLLMClientError: too long, ids
            # outside the vocabulary, bad sampling values) with 400, pydantic's with 422.
            raise RequestRejected(f"vLLM server refused the request: {exc}") from exc
        if not is_retryable(exc):
            return False
        if failures > self.pool.options.retries:
            raise EngineUnavailable(
                f"request {request_id!r} failed {failures} times; last: {exc}"
            ) from exc
        await self.pool.backoff(failures, getattr(exc, "retry_after", None))
        return True  # resubmit prompt + tokens so far, to a healthy server

    async def _attempt(
        self, stream: _Stream, generated: list[int], version: int, epoch: int
    ) -> AsyncIterator[Chunk]:
        """One submission to one server; ends on a finish, a load's abort, or at once if a
        load began while it waited for a server slot (generate() then waits and retries).

        From the POST until its first event the request counts as submitting
        (`SwapGate.submitting`), and a load waits for no submission to be left before it
        pauses the servers: the server only registers a generate request when its stream
        starts, and one registered after the pause would run on the new weights under the old
        version tag.
        """
        prompt, sampling = continuation(stream.request, generated)
        k = stream.request.sampling.logprobs
        if k:
            # One more than asked: the server cuts each position's list to `logprobs` entries
            # with the sampled token first, which would push the k-th out whenever the sampled
            # token ranks below k (wire.top_k_of). k = 20 needs servers run with
            # --max-logprobs 21 (vLLM's default is 20; a server refuses more with a 400).
            sampling["logprobs"] = k + 1
        if self._routed:
            sampling["routed_experts_prompt_start"] = len(prompt) - 1
        server = await self.pool.acquire()
        if not self._gate.current(epoch):
            self.pool.release(server)
            return
        stream.sub_id = f"{stream.request.request_id}@{next(self._serials)}"
        body = generate_body(stream.sub_id, prompt, sampling, cache_salt=f"w{version}", stream=True)
        stream.server = server
        held: list[GenerateResult] = []
        with self._gate.submitting() as running:
            try:
                async with self.pool.session().post(
                    f"{server.url}/inference/v1/generate", json=body
                ) as resp:
                    stream.response = resp
                    await raise_for_status(resp)
                    async for line in resp.content:
                        event = parse_sse_line(line)
                        if stream.aborted:
                            raise RequestAborted(
                                f"request {stream.request.request_id!r} was aborted"
                            )
                        piece = None if event is None else decode_choice(event, k)
                        if piece is None:
                            continue
                        running()  # registered and running: a pause will abort it now
                        chunk, done = self._chunk(stream, piece, held, version)
                        if chunk is not None:
                            yield chunk
                        if done:
                            return
                # The stream ended without a finish reason: the server went away mid-answer.
                raise aiohttp.ServerDisconnectedError("stream ended without a finish reason")
            except Exception as exc:
                if not stream.aborted and marks_unhealthy(exc):
                    self.pool.mark_unhealthy(server, exc)
                raise
            finally:
                stream.response = None
                self.pool.release(server)

    def _chunk(
        self, stream: _Stream, piece: GenerateResult, held: list[GenerateResult], version: int
    ) -> tuple[Chunk | None, bool]:
        """(chunk to yield or None, whether this submission is over)."""
        interrupted = piece.finish_reason == ABORT
        reason = None if interrupted else finish_reason(piece.finish_reason)
        over = interrupted or reason is not None
        if self._routed:
            held.append(piece)
            if not over:
                return None, False
            ids, logprobs = join_tokens(held)
            routes = routes_for_tokens(held[-1].routed_experts, ids.size, self._expert_dtype)
            top_ids, top_lps = _joined_tops(held)
        else:
            ids, logprobs, routes = piece.token_ids, piece.logprobs, None
            top_ids, top_lps = piece.top_token_ids, piece.top_logprobs
        if ids.size == 0 and reason is None:
            return None, over
        chunk = Chunk(
            token_ids=ids.astype(np.int32),
            logprobs=logprobs.astype(np.float32),
            routed_experts=routes,
            finish_reason=reason,
            stop_reason=(
                stop_reason(piece.stop_reason, params=stream.request.sampling, eos_ids=self._eos)
                if reason is not None
                else None
            ),
            weight_version=version,
            top_token_ids=top_ids,
            top_logprobs=top_lps,
        )
        return chunk, over

    async def generate_once(self, request: EngineRequest) -> GenerateResult:
        """The whole generation as one frozen result (with failover, like `generate`)."""
        chunks = [c async for c in self.generate(request)]
        joined = join_chunks(chunks)
        last = chunks[-1]
        return GenerateResult(
            token_ids=joined.token_ids,
            logprobs=joined.logprobs,
            finish_reason=None if last.finish_reason is None else str(last.finish_reason),
            stop_reason=last.stop_reason,
            routed_experts=joined.routed_experts,
            top_token_ids=joined.top_token_ids,
            top_logprobs=joined.top_logprobs,
        )

    # ---- abort ---------------------------------------------------------------------

    async def _stop(self, stream: _Stream) -> None:
        if stream.response is not None:
            # Wakes the reader; the server aborts a request whose client went away.
            stream.response.close()
        if stream.server is not None and stream.sub_id is not None:
            with contextlib.suppress(Exception):  # best effort: closing already aborts it
                await self.pool.post_json(
                    stream.server,
                    "/inference/v1/abort_requests",
                    {"request_ids": [server_request_id(stream.sub_id)]},
                )

    # ---- weights -------------------------------------------------------------------

    async def _swap(self, source: str, version: int) -> None:
        live = [s for s in self.pool.servers if s.healthy]
        results = await asyncio.gather(
            *(self._reload(s, source) for s in live), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, WeightLoadError)]
        if errors:
            # Refused by a server (e.g. unreadable checkpoint): put the old weights back.
            await asyncio.gather(
                *(self._reload(s, self._source) for s in live), return_exceptions=True
            )
            raise errors[0]
        self._source = source
        for server, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                # Unreachable mid-load: the prober re-syncs it before it serves again.
                self.pool.mark_unhealthy(server, result)
        self._weight_version = version

    async def _reload(self, server: Server, source: str | None) -> None:
        post = self.pool.post_json
        await post(server, "/pause", params={"mode": "abort"})
        try:
            if source is not None:
                reply = await post(
                    server, "/collective_rpc", {"method": RELOAD_METHOD, "args": [source]}
                )
                failed = [r for r in (reply or {}).get("results", []) if r]
                if failed:
                    raise WeightLoadError(f"{server.url} could not load {source}: {failed[0]}")
        finally:
            # Stale KV and prefix cache must never be reused; then serve again.
            await post(server, "/reset_prefix_cache")
            await post(server, "/resume")

    async def _sync_weights(self, server: Server, session: aiohttp.ClientSession) -> None:
        """Before a recovered server serves again: give it the current weights.

        It may have restarted (start-up weights) or missed a load; after any load of ours
        it is reloaded, whatever it reports (reloading a tiny checkpoint is cheap; serving
        stale weights under a new version tag would corrupt invariant 4)."""
        if self._source is not None:
            await self._reload(server, self._source)

    # ---- close ---------------------------------------------------------------------

    async def close(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort what is in flight and close the sessions; never raises."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._streams):
            with contextlib.suppress(Exception):  # best effort on the way out
                await self.abort(request_id)
        await self.pool.aclose()


def _joined_tops(pieces: list[GenerateResult]) -> tuple[np.ndarray | None, np.ndarray | None]:
    if pieces[0].top_token_ids is None:
        return None, None
    return (
        np.concatenate([p.top_token_ids for p in pieces]),
        np.concatenate([p.top_logprobs for p in pieces]),
    )
