"""An episode's fields of a result body (``store.episode_results``), as ``schemas.Result``
declares them: absent from a plain rollout's result (not null: a plain result's body is what
it was before episodes), present for an episode's. Apart from ``schemas`` so that module stays
readable in one sitting; the models are named ``Episode*`` so that no chat-completions
``ToolCall`` of an OpenAI body can share a component name with them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.config import JsonDict
from pydantic.json_schema import SkipJsonSchema

from .fields import NonNegInt, PackedArray, Strict


class EpisodeToolClaim(Strict):
    """One runner's hold on a call: how it ended (null while it is live), its run time as the
    runner reported it, the failure's message or the lost claim's detail, and for a lost
    claim the decision recovery took by the tool's declared effect."""

    claim: int = Field(ge=1)
    runner_id: str
    outcome: Literal["result", "env_error", "env_fatal", "lost"] | None
    seconds: float
    error: str
    decision: Literal["idempotent", "restore", "restart"] | None = Field(
        description="for a lost claim: idempotent (run again), restore (the last result's "
        "revision restored, then run again), restart (the episode failed, effect_unverified)"
    )
    claimed_at: float
    ended_at: float | None


class EpisodeToolCall(Strict):
    """A tool call of an episode, where its observation sits in ``response_token_ids``
    (``offset``, ``observation_tokens``), and everything that happened to it."""

    call_id: str
    name: str
    arguments: str
    idempotency_key: str
    turn: int = Field(ge=0)
    offset: int = Field(ge=0, description="where its observation starts in response_token_ids")
    observation_tokens: int = Field(ge=0, description="its observation's length (0 without)")
    env_handle: str
    env_revision: str
    seconds: float = Field(description="run time summed over its claims")
    outcome: Literal["result", "pending", "failed", "abandoned"] = Field(
        description="abandoned: the episode ended (cancelled, a budget) before it had a result"
    )
    claims: list[EpisodeToolClaim]
    requested_at: float


# ``X | SkipJsonSchema[None] = None``: optional in the document, never null in it; the default
# is only what the model holds for a body without the field, so the document shows none
# (a default of null beside a type that is never null would contradict it).


def _no_default(schema: JsonDict) -> None:
    schema.pop("default", None)


def _optional(description: str) -> Any:
    return Field(json_schema_extra=_no_default, description=description)


LossMask = Annotated[
    PackedArray | SkipJsonSchema[None],
    _optional(
        "episodes only, as every array of the result then spans the whole context after the "
        "prompt (sampled and observation tokens in the order the engine was fed them): uint8, "
        "1 for a sampled token, 0 for an observation's"
    ),
]
Turns = Annotated[
    list[Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]] | SkipJsonSchema[None],
    _optional("episodes only: each turn's sampled tokens as [start, end) of response_token_ids"),
]
ToolCalls = Annotated[
    list[EpisodeToolCall] | SkipJsonSchema[None],
    _optional("episodes only: every tool call, in the order the model made them"),
]
RoutesPresent = Annotated[
    PackedArray | None,
    _optional(
        "episodes only: uint8 0/1 aligned with routed_experts, 1 where the row holds routes "
        "(an observation token's rows come from the next turn's prefill where the engine "
        "returns them, else they are zero and absent); null for a dense model"
    ),
]
