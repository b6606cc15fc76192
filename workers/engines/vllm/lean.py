"""Lean outputs for stepped requests: what the stepper needs of each vLLM output, without the
``RequestOutput`` vLLM builds for ``generate``.

For every output of every request vLLM's output processor (``v1/engine/output_processor.py``
of vLLM 0.32, ``OutputProcessor.process_outputs``) turns the sampled token's logprob into a
``FlatLogprobs`` entry (three ``tolist`` calls and four list appends per token,
``LogprobsProcessor.update_from_output``), then slices that growing container and wraps the
slice in a ``CompletionOutput`` and a ``RequestOutput`` (``RequestState.make_request_output``).
The stepper reads back one float per token. Profiled on in-process vLLM with 16 rollouts in
flight, those two calls were ~13% of the worker process's CPU; without them the process spent
12-18 us less per token (62-64 against 74-82, 64 x 128 tokens, whole steps, no worker).

``install`` replaces both on one request's ``RequestState`` instance:
- its logprobs processor keeps only the sampled column of each output's ``new_logprobs``
  (one numpy slice per output, the token ids beside it for a check);
- its ``make_request_output`` returns a ``LeanOutput`` with the fields the stepper reads
  (``stepping.SteppingVllm._read``), built the way vLLM builds them: the same stream-interval
  batching and delta of token ids, the routed-expert rows joined on the final output, the
  finish reason as vLLM's string.

Only plain requests qualify: one sample (no parent request), delta outputs, no stop strings
(no detokenizing, so no stop-string trimming of tokens already counted), installed before the
request's first output was processed. Anything else keeps vLLM's own outputs, which
``_read`` still takes.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

log = logging.getLogger(__name__)
_warned: list[bool] = []  # once per process


class SampledLogprobs(NamedTuple):
    """The sampled tokens of an output as vLLM's sampler reported them (first column of its
    logprobs), and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]


class LeanOutput:
    """One output of a stepped request: ``CompletionOutput``'s fields the stepper reads."""

    __slots__ = ("finish_reason", "finished", "logprobs", "routed_experts", "stop_reason",
                 "token_ids")  # fmt: skip

    def __init__(
        self,
        token_ids: list[int],
        logprobs: SampledLogprobs,
        finish_reason: str | None,
        stop_reason: int | str | None,
        routed_experts: np.ndarray | None,
    ) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.routed_experts = routed_experts
        self.finished = finish_reason is not None  # process_outputs may set it


class _SampledOnly:
    """Stands in for one request's ``LogprobsProcessor``: the sampled column of each output's
    logprobs, kept until the next ``LeanOutput`` takes it."""

    __slots__ = ("ids", "values")

    # Read by nothing once make_request_output is replaced; present in case vLLM looks.
    logprobs = None
    prompt_logprobs = None
    cumulative_logprob = None

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.values: list[float] = []

    def update_from_output(self, output: Any) -> None:
        lists = output.new_logprobs
        if lists is not None:
            # Rows are positions; the sampler puts the sampled token first (vLLM's
            # LogprobsProcessor._update_sample_logprobs reads logprobs[0] the same way).
            self.ids += lists.logprob_token_ids[:, 0].tolist()
            self.values += lists.logprobs[:, 0].tolist()

    def take(self) -> SampledLogprobs:
        taken = SampledLogprobs(self.ids, self.values)
        self.ids, self.values = [], []
        return taken


def install_for(processor: Any, request_id: str) -> bool:
    """``install`` on the state of the request vLLM's ``OutputProcessor`` knows by the id it
    was added under (vLLM keys its states by an internal id: that id plus a random suffix)."""
    try:
        internal = processor.external_req_ids.get(request_id)
        if not internal or len(internal) != 1:
            return False
        state = processor.request_states.get(internal[0])
        return state is not None and install(state)
    except AttributeError as exc:
        # Another vLLM than the pinned one, laid out differently: its own outputs still work
        # (tests/engines/test_vllm_lean.py fails loudly on such an upgrade).
        if not _warned:
            _warned.append(True)
            log.warning("lean vLLM outputs unavailable, using vLLM's own: %r", exc)
        return False


def install(state: Any) -> bool:
    """Give vLLM's ``RequestState`` of one request lean outputs, if it qualifies (see the
    module docstring); False leaves it as it was."""
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415  (heavy imports)
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer  # noqa: PLC0415

    detok = state.detokenizer
    if (
        state.parent_req is not None
        or state.output_kind != RequestOutputKind.DELTA
        or state.streaming_input
        or type(detok) is not IncrementalDetokenizer  # the no-op one: nothing to detokenize
        or detok.num_output_tokens() != 0
        or state.sent_tokens_offset != 0
        or state.logprobs_processor is None
        or state.logprobs_processor.num_logprobs != 0
        or state.stream_interval < 1
        or not isinstance(state.routed_experts_chunks, list)  # read at the end: read now
    ):
        return False
    sampled = _SampledOnly()

    def make_request_output(
        new_token_ids: list[int],
        pooling_output: Any,
        finish_reason: Any,
        stop_reason: int | str | None,
        kv_transfer_params: Any = None,
        ec_transfer_params: Any = None,
        error: Any = None,
    ) -> LeanOutput | None:
        finished = finish_reason is not None
        if state.stream_interval > 1:
            # vLLM's batching of a stream interval, in delta mode (make_request_output).
            count = detok.num_output_tokens()
            sent = state.sent_tokens_offset
            if not (finished or sent == 0 or count - sent >= state.stream_interval):
                return None
            new_token_ids = detok.output_token_ids[sent:]
            state.sent_tokens_offset = count
        routes = None
        if finished and state.routed_experts_chunks:
            routes = np.concatenate(state.routed_experts_chunks, axis=0)
        return LeanOutput(
            token_ids=new_token_ids,
            logprobs=sampled.take(),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
            routed_experts=routes,
        )

    # The method first: were it not settable (slots), the state is left as it was.
    state.make_request_output = make_request_output
    state.logprobs_processor = sampled
    return True
