"""The bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``, as vLLM 0.32
serves them (``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``), narrowed
to what durable-rollouts generates.

The models say exactly what is accepted (``/openapi.json`` is generated from them). Fields
vLLM has but the engines cannot serve are declared with their neutral value only (``echo``
false, ``presence_penalty`` 0, ...), so a harness that sends vLLM's defaults is served and
one that asks for the feature is refused, by name (``openai_api.REFUSED`` gives the reason
first); any other field is refused as unknown. Never ignored silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from statemachine import MAX_LOGPROBS as MAX_TOP_LOGPROBS
from store import defaults

from ..fields import (
    INT64_MAX,
    ConstFalse,
    ConstOne,
    ConstTrue,
    ConstZero,
    Integral,
    NonNegInt,
    TokenIds,
)

# Top-k alternatives are recorded per token up to 20 (statemachine.MAX_LOGPROBS), vLLM's
# default --max-logprobs.
MAX_LOGPROBS = MAX_TOP_LOGPROBS
MAX_N = 1024  # samples of one call (a group); more is a batch: /v1/batches
Zero = Annotated[float, Field(ge=0.0, le=0.0)]
StopStrings = Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
TokenPrompt = Annotated[TokenIds, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Sampling(_Strict):
    """What both endpoints share: vLLM's sampling extensions and our keys."""

    model: str | None = Field(None, description="Echoed back; any name is accepted")
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), Integral] | None = Field(
        None, description="0 or -1: disabled"
    )
    min_p: Zero | None = Field(None, description="Only 0 (disabled)")
    min_tokens: NonNegInt = 0
    stop: StopStrings | None = None
    stop_token_ids: TokenIds | None = None
    seed: NonNegInt | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N), Integral] = 1
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = Field(
        None, description='Logprob tokens as "token_id:<id>" (always so without --tokenizer)'
    )
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="The call's key when no Idempotency-Key header: a retry attaches"
    )
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="Groups a trajectory's calls (else the X-Session-ID header)"
    )
    user: str | None = Field(None, description="Accepted, without effect")
    stream: ConstFalse | None = Field(None, description="Only false (no streaming)")
    # vLLM's fields the engines cannot serve: their neutral value only.
    stream_options: None = None
    echo: ConstFalse | None = None
    presence_penalty: Zero | None = None
    frequency_penalty: Zero | None = None
    repetition_penalty: Annotated[float, Field(ge=1.0, le=1.0)] | None = None
    logit_bias: None = None
    prompt_logprobs: None = None
    response_format: None = None
    structured_outputs: None = None
    use_beam_search: ConstFalse = False
    include_stop_str_in_output: ConstFalse = False
    skip_special_tokens: ConstTrue = True
    spaces_between_special_tokens: ConstTrue = True
    allowed_token_ids: None = None
    bad_words: Annotated[list[str], Field(max_length=0)] | None = None
    logprob_token_ids: None = None
    truncate_prompt_tokens: None = None
    priority: ConstZero = 0
    cache_salt: None = None
    kv_transfer_params: None = None
    vllm_xargs: None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (token ids, or text with ``--tokenizer``)."""

    prompt: (
        TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1, max_length=1)]
        | (Annotated[str, Field(min_length=1)])
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=1, le=defaults.MAX_TOKENS_CAP), Integral] | None = Field(
        16, description="null: what the model's context leaves"
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None = None
    add_special_tokens: bool = True
    suffix: None = None
    best_of: ConstOne | None = None


class CompletionTokensRequest(CompletionRequest):
    """``CompletionRequest`` of an API started without ``--tokenizer``: the prompt as token ids
    (a text prompt is refused, ``no_tokenizer``)."""

    prompt: TokenPrompt | Annotated[list[TokenPrompt], Field(min_length=1, max_length=1)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatToolFunction(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema")
    strict: bool | None = None


class ChatTool(_Strict):
    """A tool the model may call, rendered into the prompt by the chat template."""

    type: Literal["function"] = "function"
    function: ChatToolFunction


class ChatCalledFunction(_Strict):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = Field(
        description="Its arguments as JSON text (OpenAI's form; an object is accepted too)"
    )


class ChatMessageToolCall(_Strict):
    """A call an assistant message made, as a harness sends the answer's back."""

    id: str
    type: Literal["function"] = "function"
    function: ChatCalledFunction


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1)]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        None, description='null (an assistant message with tool_calls): rendered as ""'
    )
    name: str | None = None
    tool_calls: list[ChatMessageToolCall] | None = Field(None, description="An assistant's")
    tool_call_id: str | None = Field(None, description="A tool message's: the call it answers")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages, through ``--tokenizer``'s chat template.
    ``top_logprobs`` above 0 needs ``logprobs`` true."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": [
        {"anyOf": [{"properties": {"top_logprobs": {"enum": [None, 0]}}},
                   {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
        # tool_choice other than "none" needs tools (vLLM's and OpenAI's rule)
        {"anyOf": [{"properties": {"tool_choice": {"enum": [None, "none"]}}},
                   {"required": ["tools"], "properties": {"tools": {"type": "array"}}}]},
    ]})  # fmt: skip

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=defaults.MAX_TOKENS_CAP), Integral] | None = None
    max_completion_tokens: (
        Annotated[int, Field(ge=1, le=defaults.MAX_TOKENS_CAP), Integral] | None
    ) = Field(None, description="Wins over max_tokens; both null: what the context leaves")
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None = None
    add_generation_prompt: bool = True
    continue_final_message: ConstFalse = False
    add_special_tokens: ConstFalse = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = Field(
        None,
        description="Rendered by the chat template (an API whose template renders no "
        "tools refuses them); the answer's tool calls are parsed as vLLM's hermes parser does",
    )
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description='With tools: "auto" (the default) or "none" (the text is not parsed)'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: the first call only")
    reasoning_effort: None = None
    echo: ConstFalse | None = None
    documents: None = None
    chat_template: None = None


class ChatCompletionNoToolsRequest(ChatCompletionRequest):
    """``ChatCompletionRequest`` of an API whose chat template renders no tools (checked at
    start-up with a probe tool): ``tools`` are refused, ``tool_choice`` is "none" at most."""

    tools: None = None
    tool_choice: Literal["none"] | None = None


# -- responses (documentation: the handlers build plain dicts) ---------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str = Field(description='"" without --tokenizer')
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class AnsweredFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text")


class AnsweredToolCall(BaseModel):
    id: str = Field(description="call_<24 hex>, the same for a retried call")
    type: Literal["function"]
    function: AnsweredFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer was tool calls only")
    tool_calls: list[AnsweredToolCall] = Field(description="[] without tools or calls")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
