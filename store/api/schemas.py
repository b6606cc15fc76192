"""The API's request and response bodies, as pydantic models.

The handlers validate every request body with these models, and ``/openapi.json`` is
generated from them (``openapi.py``): one definition, so the document cannot drift from what
is enforced. Models are strict (no "1" for 1, no 1.0 for 1) and refuse unknown fields, as
``statemachine.request`` does; the ranges the domain checks are repeated here as constraints
so that the document tells a client what is accepted and a refusal names the exact field
(``loc``). What only the trainer API can check (ids already taken, a batch id reused for
another submission, the metadata's packed size) is still refused by it, with a 4xx.

Response models describe what the handlers send. The result stream and the rollout views are
built as plain dicts for speed (a pydantic round trip per result would halve the stream's
throughput); the tests validate every response against the served document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from store import defaults

INT64_MAX = 2**63 - 1

NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Id = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^{}:\s]+$")]
BatchId = Annotated[str, Field(min_length=1, max_length=160, pattern=r"^[^{}:\s]+$")]
GroupPolicyName = Literal["sample", "group"]
StateName = Literal["pending", "generating", "aborted", "resumed", "done", "failed", "cancelled"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- requests ---------------------------------------------------------------------------------
class Sampling(Strict):
    """vLLM-style sampling parameters (``statemachine.SamplingParams``)."""

    max_tokens: Annotated[int, Field(ge=1, le=defaults.MAX_TOKENS_CAP)]
    min_tokens: NonNegInt = 0
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] = 0
    seed: NonNegInt | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    # Top-k alternatives are not recorded: only 0 is accepted (the sampled logprob is kept).
    logprobs: Annotated[int, Field(ge=0, le=0)] = 0
    cap_to_context: bool = False


class Message(BaseModel):
    """One chat message; needs an API started with ``--tokenizer`` (its chat template)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Annotated[str, Field(min_length=1)]
    content: Any


class Prompt(Strict):
    """One prompt: token ids, or chat messages (exactly one of the two)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt_token_ids"], "not": {"required": ["messages"]}},
                {"required": ["messages"], "not": {"required": ["prompt_token_ids"]}},
            ]
        },
    )

    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    sampling: Sampling | None = None
    metadata: dict[str, Any] = {}
    max_staleness: NonNegInt | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Prompt:
        if (self.prompt_token_ids is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt_token_ids and messages")
        return self


class SubmitRequest(Strict):
    """``RolloutClient.submit``: ``n`` samples of each prompt. ``sampling`` (one, or one per
    prompt) replaces the prompts' own; every prompt needs sampling from one or the other.
    ``batch_id`` is the idempotency key: a retry returns the same ids and enqueues nothing."""

    prompts: Annotated[list[Prompt], Field(min_length=1)]
    n: Annotated[int, Field(ge=1, le=defaults.MAX_GROUP_SIZE)] = 1
    sampling: Sampling | list[Sampling] | None = None
    batch_id: BatchId | None = None
    ids: list[Id] | None = None
    group_policy: GroupPolicyName = "sample"


class Target(Strict):
    """Rollouts named by ``ids``, or a whole batch, or one group of it (``batch_id`` and
    ``group``): exactly one of ``ids`` and ``batch_id``."""

    ids: Annotated[list[Id], Field(min_length=1)] | None = None
    batch_id: BatchId | None = None
    group: NonNegInt | None = None

    @model_validator(mode="after")
    def _one_target(self) -> Target:
        if (self.ids is None) == (self.batch_id is None):
            raise ValueError("name either ids or a batch_id (with a group, for one group)")
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

    version: Annotated[int, Field(ge=1, le=INT64_MAX)]
    path: Annotated[str, Field(min_length=1, max_length=4096)]


class ResultsQuery(Strict):
    """The query of ``GET /v1/batches/{batch_id}/results`` (strings, as in a URL)."""

    after: Annotated[str, Field(pattern=r"^\d+-\d+$")] | None = None
    take: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    timeout: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None

    model_config = ConfigDict(extra="forbid", strict=False)

    @model_validator(mode="after")
    def _take_from_start(self) -> ResultsQuery:
        if self.take is not None and self.after is not None:
            raise ValueError("take counts groups from the start of the batch: no after")
        return self


# -- responses --------------------------------------------------------------------------------
class PackedArray(Strict):
    """An array as raw little-endian bytes: msgpack bin in msgpack bodies, base64 in JSON."""

    dtype: Literal["int32", "int64", "float32", "uint8", "uint16", "uint32"]
    shape: list[NonNegInt]
    data: Annotated[
        str | bytes,
        Field(json_schema_extra={"contentEncoding": "base64"}),
    ]


class ErrorDetail(Strict):
    type: str
    message: str
    field: str | None = None


class ErrorBody(Strict):
    """Every 4xx and 5xx. ``field`` names the request field at fault (``prompts.0.n``)."""

    error: ErrorDetail


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
