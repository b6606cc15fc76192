"""The answers of ``/v1/completions`` and ``/v1/chat/completions`` built from a call's results,
in vLLM 0.32's forms (``completion/serving.py``, ``chat_completion/serving.py``): per-token
logprobs as OpenAI's clients parse them, ``token_ids``/``prompt_token_ids`` when asked.

A token's string is ``"token_id:<id>"`` when asked (``return_tokens_as_token_ids``) and when
the API has no tokenizer (where vLLM would fail the call), else the tokenizer's decoding of it.
The top alternatives are read from the result's recorded top-k arrays (``top_token_ids``,
``top_logprobs``: [tokens, k]) when the rollout recorded them; vLLM's per-token dict is the
sampled token first, then the top-k (the sampled one once): completions show its first k+1
entries, chat its first k, as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from store.results import RolloutResult

# vLLM clamps -inf to the JSON-serialisable floor OpenAI uses.
FLOOR = -9999.0


class Tokens:
    """How token ids are shown: as ``token_id:<id>`` or decoded (cached per id)."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = None if as_ids else tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tokenizer.decode([token_id])
        return s


def _steps(r: RolloutResult) -> list[list[tuple[int, float]]]:
    """Per token: (id, logprob) of the sampled token, then its recorded top-k alternatives."""
    ids = r.response_token_ids.tolist()
    lps = [max(float(x), FLOOR) for x in r.logprobs.tolist()]
    top_ids = getattr(r, "top_token_ids", None)
    top_lps = getattr(r, "top_logprobs", None)
    steps = [[(t, lp)] for t, lp in zip(ids, lps, strict=True)]
    if top_ids is None or top_lps is None or np.ndim(top_ids) != 2 or len(top_ids) != len(ids):
        return steps
    for step, row_ids, row_lps in zip(steps, np.asarray(top_ids).tolist(),
                                      np.asarray(top_lps).tolist(), strict=True):  # fmt: skip
        seen = {step[0][0]}
        for t, lp in zip(row_ids, row_lps, strict=True):
            if t not in seen and t >= 0:  # a negative id pads a row with fewer alternatives
                seen.add(t)
                step.append((int(t), max(float(lp), FLOOR)))
    return steps


def completion_logprobs(r: RolloutResult, k: int, show: Tokens) -> dict[str, Any]:
    tokens: list[str] = []
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    at = 0
    for step in _steps(r):
        token = show(step[0][0])
        offsets.append(at)
        at += len(token)
        tokens.append(token)
        token_logprobs.append(step[0][1])
        tops.append({show(t): lp for t, lp in step[: k + 1]})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": tops}  # fmt: skip


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob,
            "bytes": list(token.encode("utf-8", errors="replace"))}  # fmt: skip


def chat_logprobs(r: RolloutResult, k: int, show: Tokens) -> dict[str, Any]:
    content = []
    for step in _steps(r):
        entry = _entry(show(step[0][0]), step[0][1])
        entry["top_logprobs"] = [_entry(show(t), lp) for t, lp in step[:k]]
        content.append(entry)
    return {"content": content}


def usage(results: list[RolloutResult]) -> dict[str, int]:
    prompt = len(results[0].prompt_token_ids)
    completion = sum(len(r.response_token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _finish(r: RolloutResult) -> str:
    return r.finish_reason.value if r.finish_reason is not None else "length"


def completion(
    results: list[RolloutResult], *, call_id: str, model: str, logprobs: int | None,
    token_ids: bool, show: Tokens,
) -> dict[str, Any]:  # fmt: skip
    choices = []
    for i, r in enumerate(results):
        choice: dict[str, Any] = {
            "index": i,
            "text": r.text or "",
            "logprobs": None if logprobs is None else completion_logprobs(r, logprobs, show),
            "finish_reason": _finish(r),
            "stop_reason": r.stop_reason,
        }
        if token_ids:
            choice["token_ids"] = r.response_token_ids.tolist()
            choice["prompt_token_ids"] = list(r.prompt_token_ids)
        choices.append(choice)
    return {"id": f"cmpl-{call_id}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(results)}  # fmt: skip


def chat(
    results: list[RolloutResult], *, call_id: str, model: str, top_logprobs: int | None,
    token_ids: bool, show: Tokens,
    message: Callable[[RolloutResult], tuple[dict[str, Any], bool]],
) -> dict[str, Any]:  # fmt: skip
    """``message``: a sample's message and whether it called tools (``chat_tools.message``;
    then its finish reason is ``tool_calls``, as vLLM's)."""
    choices = []
    for i, r in enumerate(results):
        said, called = message(r)
        choice: dict[str, Any] = {
            "index": i,
            "message": said,
            "logprobs": None if top_logprobs is None else chat_logprobs(r, top_logprobs, show),
            "finish_reason": "tool_calls" if called else _finish(r),
            "stop_reason": r.stop_reason,
        }
        if token_ids:
            choice["token_ids"] = r.response_token_ids.tolist()
        choices.append(choice)
    out = {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()),
           "model": model, "choices": choices, "usage": usage(results)}  # fmt: skip
    if token_ids:
        out["prompt_token_ids"] = list(results[0].prompt_token_ids)
    return out
