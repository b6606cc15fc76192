"""Choosing the next token from one position's logits, the way vLLM does.

Pure functions of a logits vector, the sampling parameters and a generator, so they can be
tested without a model and so every engine-side decision is made in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from statemachine.request import SamplingParams

# vLLM treats any temperature below this as greedy (argmax), instead of dividing by ~0.
GREEDY_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1


def step_seed(base_seed: int, position: int) -> int:
    """The generator seed for sampling the token at absolute `position` (splitmix64 mix).

    Seeding per position instead of drawing from one long-lived stream makes a seeded request
    reproducible whatever else is in flight, *and* across an abort/resume: a resume passes
    prompt + partial as its prompt, so the next token sits at the same absolute position and
    gets the same random draw as in an uninterrupted run.
    """
    z = (base_seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    # torch.Generator.manual_seed takes a signed 64-bit value: keep 63 bits.
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def banned_tokens(
    params: SamplingParams, *, n_generated: int, eos_token_ids: Iterable[int]
) -> list[int]:
    """Tokens masked out before min_tokens are reached: eos (unless ignored) and stop ids.

    Mirrors vLLM's min-tokens logits processor: while fewer than min_tokens tokens have been
    generated, nothing that would stop generation may be sampled.
    """
    if n_generated >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return sorted(banned)


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (in a copy) everything outside the top-k and outside the top-p nucleus."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # As vLLM: sort ascending, drop the low tail whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely token.
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[-1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    banned: list[int],
    generator: torch.Generator | None,
) -> tuple[int, float]:
    """Return (token id, raw logprob of that token) for one position's float32 logits [vocab].

    The logprob is taken from log_softmax of the raw logits, before the min_tokens mask,
    temperature or top-k/top-p: vLLM's default `raw_logprobs` mode, and what a trainer's
    forward pass recomputes.
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    work = logits
    if banned:
        vocab = logits.numel()
        ids = [t for t in banned if t < vocab]  # a stop id outside the vocab can never occur
        work = logits.clone()
        work[ids] = float("-inf")
    if params.temperature < GREEDY_TEMPERATURE:
        # torch.argmax returns the first maximal index: ties break to the lowest token id.
        token = int(torch.argmax(work))
    else:
        work = _top_k_top_p(work / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(work, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(raw_logprobs[token])


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens of one position and their raw logprobs, most likely first:
    vLLM's top-k for ``logprobs=k``, from the same raw distribution as ``sample``'s logprob
    (before the min_tokens mask, temperature, top-k or top-p)."""
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), min(k, logits.numel()))
    return ids.tolist(), values.tolist()
