"""The bodies of the token routes and the calls around them, as ``/openapi.json`` documents
them and the handlers validate them (vLLM 0.32's ``GenerateRequest``, less what we cannot
serve: a field we cannot honour is accepted only at its neutral value, ``null``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from ..fields import ConstZero, Integral, SessionId, Strict
from ..schemas import Timeout

# Whole-number floats (1.0) are ids too, as JSON Schema's integer says (``fields.Integral``).
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1), Integral]


class GenerateRequest(Strict):
    """``POST /inference/v1/generate`` and ``/skyrl/v1/generate``: one durable call.
    ``sampling_params`` is vLLM's ``SamplingParams`` (fields we cannot honour are refused by
    name unless neutral); ``request_id`` (else the ``Idempotency-Key`` header) keys retries."""

    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any] | None = None
    model: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    priority: ConstZero = 0
    # /render's metadata, which changes nothing when the prompt is token ids only.
    token_offsets: list[list[int]] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    # Multimodal inputs and disaggregated serving: not served (null only).
    features: None = None
    content_parts: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None


class Usage(Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogProb(Strict):
    token_id: int
    token: str  # "token_id:<id>"
    logprob: float


class LogProb(TopLogProb):
    top_logprobs: list[TopLogProb]


class LogProbs(Strict):
    content: list[LogProb]


class WeightVersionSpan(Strict):
    """Output tokens ``[start, end)`` were sampled by weights ``version`` (vLLM: a string)."""

    version: str
    start: int
    end: int


class _Choice(Strict):
    index: int
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None
    logprobs: LogProbs | None
    weight_versions: list[WeightVersionSpan]


class GenerateChoice(_Choice):
    routed_experts: str | None = Field(
        description="base64 of a .npy file, [output tokens, moe layers, top_k]"
    )


class PackedRoutes(Strict):
    """SkyRL's envelope: ``data`` (first) is base64 of the raw C-order bytes."""

    data: str
    shape: list[int]
    dtype: Literal["uint8", "int16", "int32"]


class SkyrlGenerateChoice(_Choice):
    routed_experts: PackedRoutes | None


class _Response(Strict):
    request_id: str
    model: str
    created: int
    output_mode: Literal["tokens"]
    usage: Usage
    prompt_token_ids: list[int] | None


class GenerateResponse(_Response):
    choices: list[GenerateChoice]


class SkyrlGenerateResponse(_Response):
    choices: list[SkyrlGenerateChoice]


class ModelCard(Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None


class ModelList(Strict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeRequest(Strict):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True


class TokenizeResponse(Strict):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(Strict):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(Strict):
    prompt: str


class UpdateWeightsRequest(Strict):
    """prime-rl's form: publishes the next weight version, at this path."""

    weight_dir: str = Field(min_length=1, max_length=4096)


class ControlAnswer(Strict):
    """What a control call did (``paused``: whether workers admit no new rollouts now;
    ``since``: when the pause began, unix seconds; ``running``: for ``/pause?mode=wait``, the
    rollouts still running on the workers when it answered, 0 once idle)."""

    status: Literal["ok"]
    paused: bool
    mode: Literal["keep", "abort", "wait"] | None = None
    since: float | None = None
    running: int | None = None
    weight_version: int | None = None


class PauseQuery(Strict):
    """``timeout`` (seconds; mode ``wait`` only): answer by then even if rollouts still run
    (a 504 saying how many); without it the call waits until none runs, as vLLM's does."""

    mode: Literal["keep", "abort", "wait"] = "keep"
    clear_cache: Literal["true", "false"] = "false"
    timeout: Timeout | None = None

    model_config = ConfigDict(extra="forbid", strict=False)  # strings, as in a URL


class FinishSessionQuery(Strict):
    """SkyRL's ``POST /finish_session?session_id=...``: the trajectory of that session ended."""

    session_id: SessionId

    model_config = ConfigDict(extra="forbid", strict=False)  # strings, as in a URL


class SessionFinished(Strict):
    """``released``: whether the session named a preferred worker, now forgotten (false for
    an unknown, expired or acknowledged session: nothing to release, as SkyRL expects)."""

    session_id: str
    released: bool


class WorldSize(Strict):
    world_size: int


class Sleeping(Strict):
    is_sleeping: bool
