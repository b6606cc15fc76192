"""A vLLM ``SamplingParams`` dict, as harnesses send it, mapped onto ours.

Every field of vLLM 0.32's ``SamplingParams`` is named here once, in one of three ways:

- ``_MAPPED``: the fields our engines honour, mapped onto ``statemachine.SamplingParams``
  (``n``, a group of n rollouts, and ``logprobs``, what the answer carries, are kept aside);
- ``_NEUTRAL``: fields we cannot honour, accepted only at the value that changes nothing
  (SkyRL always sends ``min_p``, ``top_k=-1`` and friends at those values); any other value
  is refused with a 422 naming the field;
- ``_NO_EFFECT``: fields that change only what the token routes do not return (the
  detokenized text, stream pacing, a cache hint): accepted at any value of their type.

A field vLLM does not know is refused by name too: nothing is ignored silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from statemachine import InvalidRequest, SamplingParams
from store import defaults

from ..errors import ApiError

# vLLM's default when the caller says nothing (vllm.SamplingParams.max_tokens = 16) is not
# what a server answers: it fills the context. We do so when the context is known.
_MAPPED = frozenset({"n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "max_tokens", "min_tokens", "logprobs",
                     "routed_experts_prompt_start"})  # fmt: skip

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "watermarking": (None,),
    "prompt_logprobs": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "logprob_token_ids": (None,),
    "output_kind": (None, 0),
    "skip_clone": (False,),
    "output_text_buffer_length": (0,),
    "structured_outputs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "extra_args": (None, {}),
    "bad_words": (None, []),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "trace_decode_token_ids": (None,),
}

# Text and pacing only: the token routes answer token ids, never text, and a call's answer
# is whole (stream_interval paces deltas nobody sees); flat_logprobs is an in-process layout.
_NO_EFFECT: dict[str, type | tuple[type, ...]] = {
    "detokenize": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool,
    "flat_logprobs": bool,
    "stream_interval": (int, type(None)),
    "skip_reading_prefix_cache": (bool, type(None)),
}

MAX_N = 1024


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a call asked of sampling: ours, the group size, and what the answer carries."""

    params: SamplingParams
    n: int
    logprobs: int | None  # None: no logprobs in the answer; k: the sampled one + top-k
    # Rows of the recorded routes the answer leaves out from the front: 1 for
    # routed_experts_prompt_start = the prompt's length (see ``sampling``), else 0.
    skip_routes: int = 0


def sampling(  # noqa: PLR0912  (one branch per kind of field, read in order)
    raw: Any, prompt_len: int, *, max_model_len: int | None, field: str = "sampling_params"
) -> Sampling:
    """``raw`` (a vLLM ``SamplingParams`` dict, or None) as ours; ``ApiError`` 422 naming
    the first field we cannot honour."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(422, "invalid_request", f"{field} must be an object", field)
    for name, value in raw.items():
        where = f"{field}.{name}"
        if name in _MAPPED:
            continue
        if name in _NEUTRAL:
            if not _is_one_of(value, _NEUTRAL[name]):
                neutral = _NEUTRAL[name][0]
                raise ApiError(
                    422, "unsupported_parameter",
                    f"{where}={value!r} is not supported by durable-rollouts (only "
                    f"{neutral!r}, which changes nothing)", where,
                )  # fmt: skip
            continue
        if name in _NO_EFFECT:
            if not _of_type(value, _NO_EFFECT[name]):
                raise ApiError(422, "invalid_request", f"{where} has the wrong type", where)
            continue
        known = f"{where} is not a sampling parameter durable-rollouts knows"
        raise ApiError(422, "unsupported_parameter", known, where)
    n = _int(raw, "n", 1, field, low=1, high=MAX_N)
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        logprobs = _int(raw, "logprobs", 0, field, low=0, high=None)
    skip_routes = _skip_routes(raw.get("routed_experts_prompt_start"), prompt_len, field)
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens"):
        if raw.get(name) is not None:
            kw[name] = raw[name]
    stop = raw.get("stop")
    if stop is not None:
        kw["stop"] = (stop,) if isinstance(stop, str) else stop
    if raw.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = raw["stop_token_ids"]
    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        # vLLM's server fills the context: so do we, capped to what the worker's model holds
        # (the worker knows its context even when this API does not: then up to the cap).
        if max_model_len is None:
            max_tokens = defaults.MAX_TOKENS_CAP
        else:
            max_tokens = max(1, max_model_len - prompt_len)
        kw["cap_to_context"] = True
    kw["max_tokens"] = max_tokens
    if logprobs:
        kw["logprobs"] = logprobs
    try:
        params = SamplingParams(**kw)
    except InvalidRequest as exc:
        message = str(exc)
        name = message.split(" ", 1)[0].strip(":")
        raise ApiError(422, "invalid_request", f"{field}.{message}", f"{field}.{name}") from None
    return Sampling(params=params, n=n, logprobs=logprobs, skip_routes=skip_routes)


def _skip_routes(start: Any, prompt_len: int, field: str) -> int:
    """Rows of the recorded routes to leave out for vLLM's ``routed_experts_prompt_start``.

    vLLM answers one row per input position from ``start`` to the last token excluded. We
    record one row per output token, the forward pass that produced it (row t: position
    len(prompt) - 1 + t; a resumed rollout re-prefills its prompt, so the prompt's own routes
    are never recorded): exactly vLLM's rows from the last prompt position, and those less
    the first from the prompt's end. Earlier starts would need prompt routes: refused."""
    ends = (prompt_len - 1, prompt_len)
    if start is not None and (isinstance(start, bool) or start not in ends):
        raise ApiError(
            422, "unsupported_parameter",
            f"{field}.routed_experts_prompt_start={start!r}: durable-rollouts records routes "
            f"for output tokens only, so it must be the last prompt position ({ends[0]}), the "
            f"prompt's length ({ends[1]}) or absent", f"{field}.routed_experts_prompt_start",
        )  # fmt: skip
    return 1 if start == prompt_len else 0


def _of_type(value: Any, types: type | tuple[type, ...]) -> bool:
    """``isinstance`` as JSON means it: true is no int (Python's bool is one)."""
    bools = types is bool or (isinstance(types, tuple) and bool in types)
    return isinstance(value, types) and (bools or not isinstance(value, bool))


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    for a in allowed:
        if a is None or isinstance(a, dict | list):
            if value == a and type(value) is type(a):
                return True
        elif isinstance(value, bool) != isinstance(a, bool):
            continue
        elif isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value) and value == a:
                return True
        elif value == a:
            return True
    return False


def _int(raw: dict[str, Any], name: str, default: int, field: str, *, low: int,
         high: int | None) -> int:  # fmt: skip
    value = raw.get(name, default)
    if value is None:
        value = default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ApiError(422, "invalid_request", f"{field}.{name} must be {bound}, got {value!r}",
                       f"{field}.{name}")  # fmt: skip
    return value
