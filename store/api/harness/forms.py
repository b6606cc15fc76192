"""The answers of the token-in/token-out routes, built from a call's results.

vLLM 0.32's ``GenerateTokensResponse`` (``/inference/v1/generate``) and SkyRL's variant of it
(``/skyrl/v1/generate``) differ only in how ``routed_experts`` travels:

- vLLM: base64 of a ``.npy`` file (``numpy2base64``), decoded by
  ``np.load(io.BytesIO(base64.b64decode(s)))``;
- SkyRL 0.4: ``{"data": <base64 of the raw C-order bytes>, "shape": [T, L, K], "dtype":
  "uint8"|"int16"|"int32"}``, the smallest dtype that holds the expert ids, ``data`` first:
  its client (``load_packed_body``) finds the blob by scanning the raw reply for
  ``"routed_experts":{"data":"``, so the reply must be compact JSON in that key order.

Rows of ``routed_experts`` are the output tokens' routes, row t the forward pass that
produced token t (vLLM's rows from the last prompt position), less the first row when
``routed_experts_prompt_start`` is the prompt's length, as vLLM's are (see ``sampling``: we
record no prompt routes). ``weight_versions`` are vLLM's spans
``[{"version": "<int>", "start", "end"}]`` over output-token indexes, ``end`` exclusive,
from the exact per-token versions each rollout records. ``finish_reason`` is ``stop`` or
``length``: a rollout's aborts (a weight update, a dead worker) are resumed, never answered.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from store.results import RolloutResult

from .sampling import Sampling

# vLLM's floor for a logprob in its answers (the OpenAI shapes' -9999.0).
LOGPROB_FLOOR = -9999.0


def response(
    results: list[RolloutResult],
    *,
    request_id: str,
    model: str,
    sampling: Sampling,
    prompt: list[int],
    return_token_ids: bool,
    packed_routes: bool,
    created: int,
) -> dict[str, Any]:
    """The whole answer of a call (``GenerateTokensResponse``)."""
    choices = [choice(i, r, sampling, packed_routes) for i, r in enumerate(results)]
    completion = sum(len(r.response_token_ids) for r in results)
    return {
        "request_id": request_id,
        "model": model,
        "created": created,
        "output_mode": "tokens",
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        },
        "prompt_token_ids": prompt if return_token_ids else None,
        "choices": choices,
    }


def choice(index: int, r: RolloutResult, sampling: Sampling, packed_routes: bool) -> dict[str, Any]:
    ids = r.response_token_ids
    return {
        # ``routed_experts`` first in the choice: SkyRL's scan needs it compact, and putting it
        # before the long arrays keeps the anchor near the front of the reply.
        "routed_experts": routes(r.routed_experts, packed_routes, sampling.skip_routes),
        "index": index,
        "token_ids": ids.tolist(),
        "finish_reason": r.finish_reason.value if r.finish_reason is not None else "stop",
        "stop_reason": r.stop_reason,
        "logprobs": logprobs(r, sampling.logprobs),
        "weight_versions": spans(r.weight_versions),
    }


def spans(versions: npt.NDArray[np.int64]) -> list[dict[str, Any]]:
    """vLLM's ``WeightVersionSpan`` list (its ``version`` is a string)."""
    if len(versions) == 0:
        return []
    cuts = np.flatnonzero(np.diff(versions)) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), len(versions)]
    return [{"version": str(int(versions[s])), "start": s, "end": e}
            for s, e in zip(starts, ends, strict=True)]  # fmt: skip


def logprobs(r: RolloutResult, k: int | None) -> dict[str, Any] | None:
    """``logprobs.content``: per token its id (``token_id``, and ``token`` as
    ``"token_id:<id>"``: renderers/prime-rl read that), its logprob and, for ``k >= 1``, the
    sampled token then the top-k alternatives (vLLM's order) when the rollout recorded them."""
    if k is None:
        return None
    ids = r.response_token_ids.tolist()
    lps = np.maximum(np.nan_to_num(r.logprobs, nan=LOGPROB_FLOOR), LOGPROB_FLOOR).tolist()
    top_ids = getattr(r, "top_token_ids", None)  # recorded top-k, once the store has them
    top_lps = getattr(r, "top_logprobs", None)
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        entry: dict[str, Any] = {"token_id": tid, "token": f"token_id:{tid}", "logprob": lp}
        tops: list[dict[str, Any]] = []
        if k >= 1:
            tops.append({"token_id": tid, "token": f"token_id:{tid}", "logprob": lp})
            if top_ids is not None and top_lps is not None:
                for alt, alt_lp in zip(top_ids[i][:k].tolist(), top_lps[i][:k].tolist(),
                                       strict=True):  # fmt: skip
                    if alt != tid:
                        alt_lp = LOGPROB_FLOOR if math.isnan(alt_lp) else max(LOGPROB_FLOOR, alt_lp)
                        tops.append({"token_id": alt, "token": f"token_id:{alt}",
                                     "logprob": alt_lp})  # fmt: skip
        entry["top_logprobs"] = tops
        content.append(entry)
    return {"content": content}


def routes(routed: npt.NDArray[Any] | None, packed: bool, skip: int = 0) -> Any:
    if routed is None:
        return None
    routed = routed[skip:]
    if not packed:
        return npy_base64(routed)
    return packed_routes(routed)


def npy_base64(arr: npt.NDArray[Any]) -> str:
    """What vLLM's ``numpy2base64`` sends: base64 of the array saved as a ``.npy`` file."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def smallest_dtype(arr: npt.NDArray[Any]) -> np.dtype[Any]:
    """SkyRL's canonical dtype for expert ids: the smallest of uint8, int16, int32."""
    if arr.size == 0:
        return np.dtype(np.uint8)
    low, high = int(arr.min()), int(arr.max())
    if low >= 0 and high <= np.iinfo(np.uint8).max:
        return np.dtype(np.uint8)
    if low >= np.iinfo(np.int16).min and high <= np.iinfo(np.int16).max:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def packed_routes(arr: npt.NDArray[Any]) -> dict[str, Any]:
    """SkyRL's envelope, ``data`` first (``load_packed_body`` scans for it)."""
    compact = np.ascontiguousarray(arr, dtype=smallest_dtype(arr).newbyteorder("<"))
    return {
        "data": base64.b64encode(compact.tobytes()).decode("ascii"),
        "shape": list(compact.shape),
        "dtype": compact.dtype.name,
    }


def compact_json(body: Any) -> bytes:
    """Compact JSON, keys in insertion order: what SkyRL's raw scan needs."""
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def sse(chunks: list[dict[str, Any]]) -> bytes:
    """Server-sent events as vLLM streams them: ``data: <json>`` per chunk, then
    ``data: [DONE]``."""
    lines = [b"data: " + compact_json(c) + b"\n\n" for c in chunks]
    return b"".join(lines) + b"data: [DONE]\n\n"


def stream_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished answer as vLLM's ``GenerateTokensStreamResponse`` chunks: per choice, one
    delta with every token (the call's answer is whole when it is sent), the finish reason
    and the weight spans; the first chunk carries ``prompt_token_ids`` when asked, the last
    the usage."""
    out: list[dict[str, Any]] = []
    for c in body["choices"]:
        out.append({"request_id": body["request_id"], "output_mode": "tokens",
                    "prompt_token_ids": body["prompt_token_ids"] if not out else None,
                    "choices": [c], "usage": None})  # fmt: skip
    if out:
        out[-1]["usage"] = body["usage"]
    return out
