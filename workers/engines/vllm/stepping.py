"""Whole engine steps from in-process vLLM (``StepEngine``), for the worker's stepper.

vLLM's output handler turns each engine-core step into one ``RequestOutput`` per request and
puts it into that request's collector, all in one synchronous loop. ``generate`` then costs one
collector wake-up, one async-iterator step and one ``Chunk`` per token per request. Here each
request's collector hands its outputs to this engine instead (its ``put`` is replaced on the
instance: the output processor calls ``req_state.queue.put``, ``v1/engine/output_processor.py``
of vLLM 0.32), so a step's outputs for every request wake the consumer once and come out as one
``Step``. A plain request's outputs are ``lean.LeanOutput``s, not vLLM's ``RequestOutput``s:
vLLM's per-token logprob containers and output objects were ~13% of the worker process's CPU
(``lean.py``).

Everything else is ``generate``'s: the same submission (``_submit``), the same weight-swap
protocol (an "abort" a load caused resubmits ``prompt + tokens so far`` under the new version
once the gate opens, ``swap.py``; one vLLM did on its own ends the request with
``RequestAborted``), the same finish and stop reasons, routes held back until a sub-request
ends (vLLM gives them only on its final output), late outputs after ``abort`` dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from statemachine.request import SamplingParams
from workers.engines.base import End, EngineRequest, Step
from workers.engines.errors import EngineClosed, EngineDead, EngineError, RequestAborted
from workers.engines.vllm import lean
from workers.engines.vllm.swap import SubRequest, SwappingEngine
from workers.engines.vllm.translate import (
    ABORT,
    finish_reason,
    flat_top,
    routes_for_tokens,
    stop_reason,
)


@dataclass(eq=False)
class SteppedRequest(SubRequest):
    """A request added with ``add``: what its sub-requests produced so far."""

    generated: list[int] = field(default_factory=list)
    epoch: int = 0  # the gate's epoch its current sub-request was submitted under
    version: int = 0  # the weights its current sub-request runs on
    held: list[Any] = field(default_factory=list)  # completions held for their routes


class _Piece:
    """One request's tokens within a step being built."""

    __slots__ = ("ids", "logprobs", "routes", "stream", "tops")

    def __init__(self, stream: SteppedRequest) -> None:
        self.stream = stream
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.routes: np.ndarray | None = None
        self.tops: list[tuple[np.ndarray, np.ndarray]] = []  # [n, k] each (logprobs=k)


class SteppingVllm(SwappingEngine[SubRequest]):
    """``add``/``steps`` for the in-process vLLM engine (``local.VllmEngine``)."""

    # Provided by VllmEngine.
    _llm: Any  # vLLM's AsyncLLM
    _eos: frozenset[int]
    _expert_dtype: np.dtype | None
    _routed: bool

    def _init_steps(self) -> None:
        self._stepped: dict[str, SteppedRequest] = {}  # added, end not yet handed out
        self._outputs: list[tuple[SteppedRequest, Any]] = []  # since the last step
        self._ends: dict[str, End] = {}  # ends found outside outputs (aborts, failed resubmits)
        self._woken = asyncio.Event()
        self._resubmits: set[asyncio.Task[None]] = set()

    def _check(self, request: EngineRequest) -> None:
        raise NotImplementedError

    async def _submit(self, stream: SubRequest, generated: list[int], version: int) -> Any:
        raise NotImplementedError

    async def add(self, request: EngineRequest) -> None:
        self._check(request)
        rid = request.request_id
        stream = SteppedRequest(request=request, wake=asyncio.Event())
        self._track(rid, stream)
        self._stepped[rid] = stream
        try:
            await self._submit_next(stream)
        except BaseException:
            self._stepped.pop(rid, None)
            self._untrack(rid, stream)
            raise

    async def _submit_next(self, stream: SteppedRequest) -> None:
        """Submit ``prompt + generated`` once no load runs, and take its outputs."""
        await self._gate.wait_open(stream.wake)
        if stream.aborted:
            return
        stream.epoch, stream.version = self._gate.epoch, self._weight_version
        collector = await self._submit(stream, stream.generated, stream.version)
        if stream.aborted:
            # abort() came while it was being submitted, before it had a sub-request id.
            await self._llm.abort(stream.sub_id)
            return
        # vLLM's output processor calls collector.put(output) for each output of this
        # sub-request (see the module docstring): they come here instead, one wake-up a step.
        assert stream.sub_id is not None  # set by _submit
        lean.install_for(self._llm.output_processor, stream.sub_id)  # if it qualifies
        take = partial(self._take_output, stream, stream.sub_id)
        collector.put = take
        early, collector.output = collector.output, None
        if early is not None:  # an output that came before put was replaced
            take(early)

    def _take_output(self, stream: SteppedRequest, sub_id: str | None, output: Any) -> None:
        if stream.aborted or stream.sub_id != sub_id:
            return  # late output of an aborted request, or of a sub-request a swap ended
        self._outputs.append((stream, output))
        self._woken.set()

    async def steps(self) -> AsyncIterator[Step]:
        while self._stepped or self._outputs or self._ends:
            if self._closed:
                closed = EngineClosed("engine closed while the request was in flight")
                ends = {rid: End(error=closed) for rid in self._stepped}
                self._stepped.clear()
                yield Step.only_ends(ends)
                return
            if not self._outputs and not self._ends:
                self._woken.clear()
                await self._woken.wait()
                continue
            outputs, self._outputs = self._outputs, []
            ends, self._ends = self._ends, {}
            for step in self._build(outputs, ends):
                yield step

    def _build(self, outputs: list[tuple[SteppedRequest, Any]], ends: dict[str, End]) -> list[Step]:
        pieces: dict[str, _Piece] = {}
        for stream, output in outputs:
            rid = stream.request.request_id
            if rid not in self._stepped:
                continue  # ended already (aborted)
            if isinstance(output, Exception):
                if isinstance(output, EngineDead) or _is_engine_dead(output):
                    raise EngineDead(f"vLLM's engine died: {type(output).__name__}: {output}")
                ends[rid] = End(error=EngineError(f"vLLM failed the request: {output!r}"))
                self._close_stream(stream)
                continue
            try:
                end = self._read(stream, output, pieces)
            except EngineError as exc:
                end = End(error=exc)
            if end is not None:
                ends[rid] = end
                self._close_stream(stream)
        return _steps(pieces, ends)

    def _read(self, stream: SteppedRequest, output: Any, pieces: dict[str, _Piece]) -> End | None:
        """One output of the request into ``pieces``; its end, if it ended."""
        completion = output if isinstance(output, lean.LeanOutput) else output.outputs[0]
        interrupted = completion.finish_reason == ABORT
        reason = None if interrupted else finish_reason(completion.finish_reason)
        ids = completion.token_ids
        k = stream.request.sampling.logprobs
        if self._routed:
            stream.held.append(completion)
            if reason is None and not interrupted:
                return None
            held, stream.held = stream.held, []
            ids = [t for c in held for t in c.token_ids]
            if ids:
                assert self._expert_dtype is not None
                piece = self._piece(stream, pieces)
                piece.routes = routes_for_tokens(
                    held[-1].routed_experts, len(ids), self._expert_dtype
                )
                for c in held:
                    piece.ids += c.token_ids
                    piece.logprobs += _sampled(c.logprobs, c.token_ids)
                    if k:
                        piece.tops.append(flat_top(c.logprobs, len(c.token_ids), k))
        elif ids:
            piece = self._piece(stream, pieces)
            piece.ids += ids
            piece.logprobs += _sampled(completion.logprobs, ids)
            if k:
                # Never a lean output: those are only installed for requests asking no top-k.
                piece.tops.append(flat_top(completion.logprobs, len(ids), k))
        stream.generated += ids
        if interrupted:
            if self._gate.current(stream.epoch):
                return End(
                    error=RequestAborted(
                        f"request {stream.request.request_id!r} was aborted by vLLM"
                    )
                )
            # A load interrupted it: resubmit the rest under the new weights once it is done.
            task = asyncio.create_task(self._resubmit(stream))
            self._resubmits.add(task)  # held until done: the loop keeps weak references only
            task.add_done_callback(self._resubmits.discard)
            return None
        if reason is None:
            return None
        params: SamplingParams = stream.request.sampling
        raw = completion.stop_reason
        return End(
            finish_reason=reason, stop_reason=stop_reason(raw, params=params, eos_ids=self._eos)
        )

    def _piece(self, stream: SteppedRequest, pieces: dict[str, _Piece]) -> _Piece:
        rid = stream.request.request_id
        piece = pieces.get(rid)
        if piece is None or piece.stream.version != stream.version:
            piece = pieces[rid] = _Piece(stream)
        return piece

    async def _resubmit(self, stream: SteppedRequest) -> None:
        try:
            await self._submit_next(stream)
        except Exception as exc:
            # The resubmission failed (vLLM refused it, or died): the request ends with it.
            if stream.request.request_id in self._stepped:
                self._ends[stream.request.request_id] = End(error=exc)
                self._close_stream(stream)
                self._woken.set()

    def _close_stream(self, stream: SteppedRequest) -> None:
        rid = stream.request.request_id
        if self._stepped.get(rid) is stream:
            del self._stepped[rid]
        self._untrack(rid, stream)

    def _stepped_stop(self, stream: SteppedRequest) -> None:
        """abort() of a request added with ``add``: its end is reported, as an abort."""
        rid = stream.request.request_id
        if self._stepped.get(rid) is stream:
            del self._stepped[rid]
            self._ends[rid] = End(error=RequestAborted(f"request {rid!r} was aborted"))
            self._woken.set()


def _sampled(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs from a lean output's, or from vLLM's flat logprobs
    (``local.sampled_logprobs``, without a numpy array per output: at one token per output
    that dominated)."""
    if isinstance(logprobs, lean.SampledLogprobs):
        if logprobs.token_ids != token_ids:
            raise EngineError(
                f"vLLM's logprobs are not those of the sampled tokens: {len(logprobs.token_ids)}"
                f" reported for {len(token_ids)} tokens"
            )
        return logprobs.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        n = 0 if logprobs is None else len(logprobs)
        raise EngineError(f"vLLM returned {n} logprobs for {len(token_ids)} tokens")
    starts = logprobs.start_indices
    if [logprobs.token_ids[s] for s in starts] != list(token_ids):
        raise EngineError("vLLM's logprobs are not those of the sampled tokens")
    values: list[float] = logprobs.logprobs
    return [values[s] for s in starts]


def _steps(pieces: dict[str, _Piece], ends: dict[str, End]) -> list[Step]:
    """Pieces as steps (one per weight version, normally one), the ends in the last."""
    by_version: dict[int, list[_Piece]] = {}
    for piece in pieces.values():
        by_version.setdefault(piece.stream.version, []).append(piece)
    steps: list[Step] = []
    for version, group in by_version.items():
        counts = [len(p.ids) for p in group]
        routes = [p.routes for p in group if p.routes is not None]
        steps.append(
            Step(
                request_ids=[p.stream.request.request_id for p in group],
                token_ids=np.array([t for p in group for t in p.ids], dtype=np.int32),
                logprobs=np.array([x for p in group for x in p.logprobs], dtype=np.float32),
                counts=None if all(c == 1 for c in counts) else np.array(counts),
                routed_experts=np.concatenate(routes) if routes else None,
                weight_version=version,
                **_tops(group),
            )
        )
    if not steps:
        return [Step.only_ends(ends)] if ends else []
    last = steps[-1]
    steps[-1] = Step(
        request_ids=last.request_ids, token_ids=last.token_ids, logprobs=last.logprobs,
        counts=last.counts, routed_experts=last.routed_experts,
        weight_version=last.weight_version, ends=ends,
        top_token_ids=last.top_token_ids, top_logprobs=last.top_logprobs,
    )  # fmt: skip
    return steps


def _tops(group: list[_Piece]) -> dict[str, Any]:
    """A step's top-k arrays [T, K], K the widest k of its pieces (the rows of a narrower or
    no request zero-padded, as ``Step`` allows); nothing when no piece asked for them."""
    width = max((p.stream.request.sampling.logprobs for p in group), default=0)
    if not width:
        return {}
    total = sum(len(p.ids) for p in group)
    ids = np.zeros((total, width), dtype=np.int32)
    lps = np.zeros((total, width), dtype=np.float32)
    at = 0
    for p in group:
        for top_ids, top_lps in p.tops:
            n, k = top_ids.shape
            ids[at : at + n, :k], lps[at : at + n, :k] = top_ids, top_lps
            at += n
        if not p.tops:
            at += len(p.ids)
    return {"top_token_ids": ids, "top_logprobs": lps}


def _is_engine_dead(exc: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError  # noqa: PLC0415

    return isinstance(exc, EngineDeadError)
