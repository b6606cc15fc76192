"""The bodies of episodes over HTTP: the ``episode`` a prompt may carry (``EpisodeSpec``), and
the environment routes' requests and answers (``EnvironmentClient``'s calls).

Strict like ``schemas``, and for the same reason: the document is generated from these, so it
says what is accepted. What JSON Schema cannot state is said in the descriptions and refused
by the domain with a 422 naming the field: tool names declared twice.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from store import defaults

from .fields import (
    INT64_MAX,
    EnvQueue,
    Id,
    Int32TokenIds,
    Integral,
    StateName,
    Strict,
    TokenIds,
)

NonEmpty = Annotated[str, Field(min_length=1)]
# Budgets in seconds: finite and positive (zero would end an episode before its first step);
# at most a year, so that JSON's numbers beyond a float's range are refused as out of range.
Budget = Annotated[float, Field(gt=0.0, le=3.2e7, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX), Integral]
Claim = Annotated[int, Field(ge=1, le=INT64_MAX), Integral]
Lease = Annotated[float, Field(ge=0.001, le=defaults.TOOL_LEASE_MAX_S, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0.0, le=3.2e7, allow_inf_nan=False)]
# What the environment tells about its state and failures: kept with each event, so bounded.
EnvText = Annotated[str, Field(max_length=4096)]

# At least one way for a turn to end at a tool call (``EpisodeSpec``'s own rule).
_ENDS_A_TURN: JsonDict = {
    "anyOf": [
        {"required": ["tool_call_stop_token_ids"],
         "properties": {"tool_call_stop_token_ids": {"minItems": 1}}},
        {"required": ["tool_call_stop_strings"],
         "properties": {"tool_call_stop_strings": {"anyOf": [
             {"type": "string"}, {"type": "array", "minItems": 1}]}}},
        {"required": ["parser"], "properties": {"parser": {"type": "string"}}},
    ]
}  # fmt: skip


class Tool(Strict):
    """A tool the episode may call, and what recovery does with a call of it whose effect is
    unverified (its runner lost between the claim and a result): run it again
    (``idempotent``), restore the last recorded revision and run it (``restore``), or fail the
    episode (``restart``, also what a tool not declared gets)."""

    name: NonEmpty
    effect: Literal["idempotent", "restore", "restart"] = "restart"


class Episode(Strict):
    """A multi-turn episode (``statemachine.episode.EpisodeSpec``): generation stops at a tool
    call on ``tool_call_stop_token_ids`` or ``tool_call_stop_strings`` (or ``parser``, a
    parser of the model's tool-call syntax, not served by workers yet): at least one of the
    three. Its calls wait on environment queue ``env_queue`` for a runner. ``tools``: each
    name at most once. Budgets (null: none), each ending the episode with its own finish
    reason: ``max_turns``, ``max_total_tokens`` (sampled + observation tokens),
    ``max_tool_seconds`` (the calls' run times), ``max_wall_seconds`` (from submission)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ENDS_A_TURN)

    tool_call_stop_token_ids: TokenIds = []
    tool_call_stop_strings: NonEmpty | list[NonEmpty] = []
    parser: NonEmpty | None = None
    tools: list[Tool] = []
    max_turns: Count | None = None
    max_total_tokens: Count | None = None
    max_tool_seconds: Budget | None = None
    max_wall_seconds: Budget | None = None
    env_queue: EnvQueue = "default"

    @model_validator(mode="after")
    def _ends_a_turn(self) -> Episode:
        if not (self.tool_call_stop_token_ids or self.tool_call_stop_strings or self.parser):
            raise ValueError(
                "give tool_call_stop_token_ids, tool_call_stop_strings or a parser: without "
                "one no turn can end at a tool call"
            )
        return self


# -- the environment routes -------------------------------------------------------------------
class ClaimRequest(Strict):
    """Claim the oldest pending call of the queue for ``runner_id``, leased for ``lease_s``
    (default: the API's, 15 s), waiting up to ``timeout_s`` for one (0: answer at once)."""

    runner_id: Id
    lease_s: Lease | None = None
    timeout_s: Annotated[
        float, Field(ge=0.0, le=defaults.API_CLAIM_WAIT_MAX_S, allow_inf_nan=False)
    ] = 0.0


class ToolCall(Strict):
    """A claimed call: what to run, and its fence (``rollout_id``, ``call_id``, ``claim``) for
    every report about it. ``idempotency_key`` is the same for every claim of the call.
    ``env_handle``/``env_revision``: those recorded with the episode's last result ("" before
    any); ``restore``: go back to that revision before running the call (an earlier claim of it
    was lost, and the tool declares ``restore``). ``arguments`` is the call as the worker
    wrote it (without a parser: the JSON ``{"token_ids": [...]}`` of the turn's tokens).
    ``lease_s``: the claim's lease; heartbeat well within it."""

    rollout_id: str
    call_id: str
    claim: int
    runner_id: str
    name: str
    arguments: str
    idempotency_key: str
    effect: Literal["idempotent", "restore", "restart"]
    env_handle: str
    env_revision: str
    restore: bool
    lease_s: float


class HeartbeatRequest(Strict):
    """Renew the claim's lease for ``lease_s`` (default: the API's)."""

    claim: Claim
    lease_s: Lease | None = None


class Heartbeat(Strict):
    rollout_id: str
    call_id: str
    claim: int
    lease_s: float


class ResultRequest(Strict):
    """The claim's result: ``observation_token_ids``, what the engine is fed before the next
    turn (the tool's output with its chat-template tokens), int32 token ids;
    ``env_handle``/``env_revision`` name the environment's state after the call ("" if none);
    ``seconds``: how long the call ran."""

    claim: Claim
    observation_token_ids: Int32TokenIds
    seconds: Seconds
    env_handle: EnvText = ""
    env_revision: EnvText = ""


class FailureRequest(Strict):
    """The claim failed: ``env_error`` (transient: the call is claimable again within the
    API's retries, then the episode fails) or ``env_fatal`` (the episode fails now)."""

    claim: Claim
    failure: Literal["env_error", "env_fatal"]
    error: EnvText = ""
    seconds: Seconds = 0.0


class EpisodeAfter(Strict):
    """The episode after a report: ``next_turn`` (its next turn is queued for a worker),
    ``awaiting_tool`` (an ``env_error`` within its retries: the call waits for a new claim),
    or ended (``done`` with a budget's ``finish_reason``; ``failed`` with its ``failure``)."""

    rollout_id: str
    call_id: str
    status: StateName
    finish_reason: str | None
    failure: str | None
    error: str | None
