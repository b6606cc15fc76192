"""Our requests and chunks in vLLM's terms, both ways, for the in-process and HTTP engines:
sampling parameters and resubmissions in; finish reasons, stop reasons and routed-expert rows
out.

Imports neither vllm nor aiohttp, so both engines (and their unit tests) can use it alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from statemachine.request import SamplingParams
from statemachine.status import FinishReason
from workers.engines.base import EngineRequest
from workers.engines.errors import EngineError

# vLLM's finish reasons as strings (vllm.v1.engine.FinishReason.__str__ and the HTTP API).
# "abort" is not a finish: the engines turn it into RequestAborted or a transparent resubmit.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
ABORT = "abort"


def continuation(request: EngineRequest, generated: list[int]) -> tuple[list[int], dict[str, Any]]:
    """Prompt and vLLM sampling kwargs that continue `request` after `generated` tokens.

    Used for the first submission (`generated` empty) and for the engine's own resubmission
    after a weight swap, exactly like the worker's resume: prompt + partial, budgets reduced.
    """
    params = request.sampling
    n = len(generated)
    return list(request.prompt_token_ids) + generated, sampling_kwargs(
        params, max_tokens=params.max_tokens - n, min_tokens=max(0, params.min_tokens - n)
    )


def sampling_kwargs(params: SamplingParams, *, max_tokens: int, min_tokens: int) -> dict[str, Any]:
    """vLLM SamplingParams fields (same names in-process and in the HTTP API's JSON)."""
    return {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # vLLM spells "no top-k" as 0 or -1; our SamplingParams normalises to 0.
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        # The sampled token's logprob, plus the top-k when asked (logprobs=k); vLLM's default
        # logprobs_mode is "raw_logprobs" (before temperature/top-k/top-p), as Chunk promises.
        "logprobs": params.logprobs,
    }


def finish_reason(reason: str | None) -> FinishReason | None:
    """Our finish reason for vLLM's string (None while running); errors raise."""
    if reason is None:
        return None
    try:
        return _FINISH[reason]
    except KeyError:
        # "error", "repetition" or a reason added by a later release: not a clean finish.
        raise EngineError(f"vLLM finished the request with reason {reason!r}") from None


def stop_reason(
    raw: int | str | None, *, params: SamplingParams, eos_ids: frozenset[int]
) -> int | str | None:
    """vLLM's stop reason in the protocol's terms: None for every eos.

    vLLM reports a generation_config eos that differs from the tokenizer's as a stop token
    (stop_reason = its id); the protocol (and the CPU engine) says eos is eos, whichever
    file named it, unless the caller also asked for that id as a stop token.
    """
    if isinstance(raw, int) and raw in eos_ids and raw not in params.stop_token_ids:
        return None
    return raw


def routes_for_tokens(routed: Any, n_tokens: int, dtype: np.dtype) -> np.ndarray:
    """One routing row per generated token from vLLM's `routed_experts` output.

    vLLM returns `[positions, moe_layers, top_k]` from `routed_experts_prompt_start` (we set
    it to the last prompt position) up to the last token *excluded* (no forward ran on it):
    exactly `n_tokens` rows, row t being the forward that produced token t.
    """
    if routed is None:
        raise EngineError("routed experts were enabled but vLLM returned none")
    arr = np.asarray(routed)
    if arr.ndim != 3 or arr.shape[0] != n_tokens:
        raise EngineError(
            f"vLLM returned routed experts of shape {arr.shape} for {n_tokens} tokens; "
            "expected [n_tokens, moe_layers, top_k]"
        )
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise EngineError(f"routed expert ids outside 0..{np.iinfo(dtype).max}")
    return arr.astype(dtype)


def flat_top(logprobs: Any, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-k ids and logprobs [n, k] of vLLM's ``FlatLogprobs`` for ``n`` positions.

    With ``flat_logprobs=True`` each position holds k + 1 entries: the sampled token first,
    then vLLM's top-k in rank order (``append_logprobs_for_next_position``). Outputs the
    collector merged (a consumer that fell behind) went through ``FlatLogprobs.extend``, which
    rebuilds each position as a dict: the sampled token's entry then stands once, first, even
    when it is also one of the top-k. Such a position is read by rank (1 .. k)."""
    starts, ends = logprobs.start_indices, logprobs.end_indices
    if len(starts) != n:
        raise EngineError(f"vLLM returned logprobs for {len(starts)} positions, not {n}")
    ids = np.empty((n, k), dtype=np.int32)
    lps = np.empty((n, k), dtype=np.float32)
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        if e - s == k + 1:
            ids[i] = logprobs.token_ids[s + 1 : e]
            lps[i] = logprobs.logprobs[s + 1 : e]
            continue
        by_rank = {logprobs.ranks[j]: j for j in range(s, e)}
        if any(r not in by_rank for r in range(1, k + 1)):
            raise EngineError(f"vLLM returned logprobs without the top-{k} of position {i}")
        top = [by_rank[r] for r in range(1, k + 1)]
        ids[i] = [logprobs.token_ids[j] for j in top]
        lps[i] = [logprobs.logprobs[j] for j in top]
    return ids, lps
