"""The API's request and response bodies, as pydantic models.

The handlers validate every request body with these models, and ``/openapi.json`` is
generated from them (``openapi.py``): one definition, so the document cannot drift from what
is enforced. Models are strict (no "1" for 1, no true for 1) and refuse unknown fields, as
``statemachine.request`` does; the ranges the domain checks are repeated here as constraints
so that the document tells a client what is accepted and a refusal names the exact field
(``loc``). The document says exactly what is accepted, as a JSON Schema client reads it
(``tests/api/test_schema_drift.py``, and schemathesis in ``test_schemathesis.py``): patterns
in the syntax ECMA-262 and Python read alike, 1362.0 taken as the integer it is to JSON,
"exactly one of" and "only with" written as ``oneOf``/``anyOf``. What JSON Schema cannot state
is said in the descriptions and refused with a 4xx naming the field: one ``sampling`` per
prompt when a list, ``ids`` counting prompts x n, ``min_tokens`` <= ``max_tokens``, at most
100,000 rollouts, metadata's packed size; and what only the store knows (ids already taken, a
batch id reused for another submission, a stale weight version: 409; an unknown batch, group
or rollout: 404).

Response models describe what the handlers send. The result stream and the rollout views are
built as plain dicts for speed (a pydantic round trip per result would halve the stream's
throughput); the tests validate every response against the served document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic.json_schema import SkipJsonSchema

from statemachine import MAX_LOGPROBS
from store import defaults

from .env_schemas import Episode
from .episode_schemas import LossMask, RoutesPresent, ToolCalls, Turns
from .fields import (
    INT64_MAX,
    NOT_NULL,
    VERSION_MAX,
    BatchId,
    GroupPolicyName,
    Id,
    Integral,
    Metadata,
    NonNegInt,
    PackedArray,
    SessionId,
    StateName,
    Strict,
    TokenIds,
)


# -- requests ---------------------------------------------------------------------------------
class Sampling(Strict):
    """vLLM-style sampling parameters (``statemachine.SamplingParams``); ``min_tokens`` at
    most ``max_tokens``."""

    max_tokens: Annotated[int, Field(ge=1, le=defaults.MAX_TOKENS_CAP), Integral]
    min_tokens: NonNegInt = 0
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), Integral] = 0
    seed: NonNegInt | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] = []
    stop_token_ids: TokenIds = []
    ignore_eos: bool = False
    # vLLM's logprobs=k: the k most likely tokens per generated token and their logprobs,
    # recorded with the tokens and returned in the result (the sampled logprob is always kept).
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] = 0
    cap_to_context: bool = False


class Message(BaseModel):
    """One chat message, as the API's chat template (``--tokenizer``) takes it."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Annotated[str, Field(min_length=1)]
    content: Any


class TokensPrompt(Strict):
    """One prompt as token ids: what an API started without ``--tokenizer`` takes;
    ``episode``: it is a multi-turn episode (``Episode``)."""

    # Not in the document (so not allowed by it): named here only to refuse it by name, first
    # (the missing prompt_token_ids would be the first error otherwise).
    messages: SkipJsonSchema[Any] = None
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    sampling: Sampling | None = None
    metadata: Metadata = {}
    max_staleness: NonNegInt | None = None
    episode: Episode | None = None

    @field_validator("messages")
    @classmethod
    def _no_messages(cls, value: Any) -> Any:
        raise ValueError(
            "messages need an API started with --tokenizer (its chat template); this one "
            "takes prompt_token_ids"
        )


class Prompt(Strict):
    """One prompt: token ids, or chat messages (exactly one of the two); ``episode``: it is a
    multi-turn episode (``Episode``)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            # Exactly one of the two given non-null (either may be there as null).
            "oneOf": [
                {"required": ["prompt_token_ids"], "properties": {"prompt_token_ids": NOT_NULL}},
                {"required": ["messages"], "properties": {"messages": NOT_NULL}},
            ]
        },
    )

    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    sampling: Sampling | None = None
    metadata: Metadata = {}
    max_staleness: NonNegInt | None = None
    episode: Episode | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Prompt:
        if (self.prompt_token_ids is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt_token_ids and messages")
        return self


_DISTINCT: JsonDict = {"uniqueItems": True}
# Every prompt needs sampling: the body's, or its own.
_SAMPLED: JsonDict = {
    "anyOf": [
        {"required": ["sampling"], "properties": {"sampling": NOT_NULL}},
        {"properties": {"prompts": {"items": {"required": ["sampling"],
                                              "properties": {"sampling": NOT_NULL}}}}},
    ]
}  # fmt: skip


class SubmitRequest(Strict):
    """``RolloutClient.submit``: ``n`` samples of each prompt. ``sampling`` (one, or a list of
    one per prompt) replaces the prompts' own; every prompt needs sampling from one or the
    other. ``batch_id`` is the idempotency key: a retry returns the same ids and enqueues
    nothing; ``ids``: one distinct id per rollout (prompts x n of them). At most
    100,000 rollouts (prompts x n) in one submit."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_SAMPLED)

    prompts: Annotated[list[Prompt], Field(min_length=1)]
    n: Annotated[int, Field(ge=1, le=defaults.MAX_GROUP_SIZE), Integral] = 1
    sampling: Sampling | Annotated[list[Sampling], Field(min_length=1)] | None = None
    batch_id: BatchId | None = None
    ids: Annotated[list[Id], Field(min_length=1, json_schema_extra=_DISTINCT)] | None = None
    group_policy: GroupPolicyName = "sample"


class SubmitTokensRequest(SubmitRequest):
    """``SubmitRequest`` of an API started without ``--tokenizer``: prompts as token ids."""

    prompts: Annotated[list[TokensPrompt], Field(min_length=1)]  # type: ignore[assignment]


# Exactly one of ids, batch_id and session (non-null), and a group only with a batch_id.
_BY_BATCH: JsonDict = {"required": ["batch_id"], "properties": {"batch_id": {"type": "string"}}}
_BY_SESSION: JsonDict = {"required": ["session"], "properties": {"session": {"type": "string"}}}
_ONE_TARGET: JsonDict = {
    "oneOf": [
        {"required": ["ids"], "properties": {"ids": {"type": "array"}}},
        _BY_BATCH,
        _BY_SESSION,
    ],
    "anyOf": [{"properties": {"group": {"type": "null"}}}, _BY_BATCH],
}


class Target(Strict):
    """Rollouts named by ``ids``, or a whole batch, or one group of it (``batch_id`` and
    ``group``), or every call of a ``session`` (``X-Session-ID``): exactly one of ``ids``,
    ``batch_id`` and ``session``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_TARGET)

    ids: Annotated[list[Id], Field(min_length=1)] | None = None
    batch_id: BatchId | None = None
    group: NonNegInt | None = None
    session: SessionId | None = None

    @model_validator(mode="after")
    def _one_target(self) -> Target:
        named = [x for x in (self.ids, self.batch_id, self.session) if x is not None]
        if len(named) != 1:
            raise ValueError(
                "name one of ids, a batch_id (with a group, for one group) or a session"
            )
        if self.group is not None and self.batch_id is None:
            raise ValueError("group needs batch_id, not ids")
        return self


class CancelRequest(Target):
    __doc__ = Target.__doc__
    reason: Annotated[str, Field(max_length=1000)] = "cancelled by the trainer"


class AckRequest(Target):
    __doc__ = Target.__doc__


class PublishWeightsRequest(Strict):
    """Weight ``version`` (above every published one) at checkpoint ``path``."""

    version: Annotated[int, Field(ge=1, le=VERSION_MAX), Integral]
    path: Annotated[str, Field(min_length=1, max_length=4096)]


# A stream entry id: two decimal integers (explicit digits: a regex's \d is Unicode to Python
# and Rust, ASCII to ECMA-262); at most 19 digits each, so within Redis' 64 bits.
Position = Annotated[str, Field(pattern=r"^[0-9]{1,19}-[0-9]{1,19}$")]
Timeout = Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]


class ResultsQuery(Strict):
    """The query of ``GET /v1/batches/{batch_id}/results`` (strings, as in a URL)."""

    after: Position | None = None
    timeout: Timeout | None = None

    model_config = ConfigDict(extra="forbid", strict=False)


class TakeRequest(Strict):
    """``POST /v1/batches/{batch_id}/take``: the first ``groups`` groups to finish, whole,
    then the rest of the batch is cancelled (``RolloutClient.results(take=k)``)."""

    groups: Annotated[int, Field(ge=1, le=INT64_MAX), Integral]
    timeout: Timeout | None = None


# -- responses --------------------------------------------------------------------------------
class ErrorDetail(Strict):
    type: str
    message: str
    field: str | None = None


class ErrorBody(Strict):
    """Every 4xx and 5xx. ``field`` names the request field at fault (``prompts.0.n``)."""

    error: ErrorDetail


class OpenAIErrorDetail(Strict):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class OpenAIErrorBody(Strict):
    """Every 4xx and 5xx of the harness endpoints (OpenAI's and vLLM's error body, which the
    harnesses' clients parse): ``param`` names the request field at fault, ``code`` is the
    status."""

    error: OpenAIErrorDetail


class SubmitResponse(Strict):
    batch_id: str
    group_size: int
    ids: list[str]


class Result(Strict):
    """A rollout's result (``store.results.RolloutResult``); ``position`` is where its
    completion sits in the batch's stream ("" when not read from a stream)."""

    rollout_id: str
    status: StateName
    prompt_token_ids: PackedArray
    response_token_ids: PackedArray
    logprobs: PackedArray
    weight_versions: PackedArray
    routed_experts: PackedArray | None
    finish_reason: str | None
    stop_reason: int | str | None
    text: str | None
    error: str | None
    failure: str | None
    attempts: int
    aborts: int
    nonfinite_logprobs: int
    stale: bool
    group_id: str | None
    metadata: dict[str, Any]
    admitted_version: int
    max_staleness: int | None
    batch_id: str
    group_index: int
    sample_index: int
    group_size: int
    position: str
    top_token_ids: PackedArray | None = Field(
        description="int32 [tokens, k]: each token's k most likely tokens, most likely first, "
        "for a request with sampling.logprobs = k; null when it asked for none"
    )
    top_logprobs: PackedArray | None = Field(
        description="float32 [tokens, k]: the raw logprobs of top_token_ids; null when none"
    )
    # An episode's own, absent from a plain rollout's result (store/episode_results.py).
    loss_mask: LossMask = None
    turns: Turns = None
    tool_calls: ToolCalls = None
    routes_present: RoutesPresent = None


class StreamError(Strict):
    """The last line of a result stream that ended before the batch did (``timeout``):
    re-attach with ``after`` = the last ``position`` received."""

    error: ErrorDetail


class Rollout(Result):
    """A rollout now, with its tokens so far (``store.event_store.EventStore.load``)."""

    seq: int
    worker_id: str | None
    weight_version: int | None
    model: str
    queue: str
    submitted_at: float
    abort_reason: str | None
    sampling: dict[str, Any]


class EventView(Strict):
    """One recorded event: its type name, sequence number, time and fields (arrays packed)."""

    type: str
    seq: int
    at: float
    fields: dict[str, Any]


class Events(Strict):
    rollout_id: str
    events: list[EventView]


class BatchInfo(Strict):
    batch_id: str
    groups: int
    group_size: int
    queue: str
    submitted_at: float
    retention_s: int
    ids: list[str]


class SessionCall(Strict):
    """One call of a session: its batch, when it was first made (unix s), its rollouts and
    their states (``gone``: acknowledged or expired on its own)."""

    batch_id: str
    at: float
    group_size: int
    ids: list[str]
    states: list[StateName | Literal["gone"]]


class Session(Strict):
    """A session's calls in the order they were made (none for an unknown session)."""

    session_id: str
    calls: list[SessionCall]


class BatchList(Strict):
    batches: list[str]


class Cancelled(Strict):
    cancelled: list[str]


class AckReport(Strict):
    acked: list[str]
    live: list[str]
    missing: list[str]


class WeightVersion(Strict):
    version: int
    path: str
    at: float


class Worker(Strict):
    worker_id: str
    in_flight: int
    weight_version: int | None
    queues: list[str]
    model: str
    heartbeat_age_s: float


class Stats(Strict):
    """Rollouts by state (live states: now; terminal states: ever), tokens ever generated,
    jobs waiting per queue, live workers, and the newest published weight version."""

    by_state: dict[str, int]
    tokens: int
    in_flight: int
    queues: dict[str, int]
    workers: list[Worker]
    latest_weight_version: int | None


class Health(Strict):
    status: Literal["ok", "unavailable"]
    redis: str
    # Why unavailable: "unreachable", or what Redis refuses writes for ("oom": out of memory,
    # "misconf": a failed RDB/AOF write, "readonly": a read-only replica).
    reason: Literal["unreachable", "oom", "misconf", "readonly"] | None = None
