"""What the in-process and the HTTP vLLM engines share: request translation and checks.

Imports neither vllm nor aiohttp, so both engines (and their unit tests) can use it alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statemachine.request import SamplingParams
from statemachine.status import FinishReason
from workers.engines.base import EngineRequest
from workers.errors import EngineError, WeightLoadError

# vLLM's finish reasons as strings (vllm.v1.engine.FinishReason.__str__ and the HTTP API).
# "abort" is not a finish: the engines turn it into RequestAborted or a transparent resubmit.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
ABORT = "abort"

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
        # 0 = the sampled token's logprob only; vLLM's default logprobs_mode is
        # "raw_logprobs" (before temperature/top-k/top-p), the quantity Chunk promises.
        "logprobs": 0,
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


def eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Every eos id of a model directory (config.json and generation_config.json)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(int(i) for i in ids)


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


def check_prompt(request: EngineRequest, *, vocab_size: int, max_model_len: int) -> None:
    """Refuse a bad prompt before it reaches vLLM, with the same errors as the CPU engine."""
    ids = request.prompt_token_ids
    if not ids:
        raise EngineError("prompt_token_ids must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"prompt token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise EngineError(
            f"prompt of {len(ids)} tokens leaves no room within max_model_len={max_model_len}"
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
