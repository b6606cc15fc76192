"""The events of one rollout's life. Past tense, frozen, each with its rollout id and seq.

``seq`` is the event's position in the rollout's log, starting at 1 for ``Submitted``.
Events carry facts only; whether a fact may follow the current state is decided in
``transitions``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from statemachine.arrays import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    frozen,
    frozen_routes,
)
from statemachine.errors import InvalidEvent
from statemachine.request import DEFAULT_QUEUE, RolloutRequest
from statemachine.status import AbortReason, FailureClass, FinishReason, GroupPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    rollout_id: str
    seq: int
    # Unix time the writer created it: for people and metrics, never for decisions (clocks
    # of different machines disagree; ``seq`` orders a rollout's events). Decoding restores
    # the stored value, so a replay is still a pure function of the log.
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_id, str) or not self.rollout_id:
            raise InvalidEvent("rollout_id must be a non-empty string")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise InvalidEvent(f"seq must be an int >= 1, got {self.seq!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Membership:
    """Where a rollout sits in what the trainer submitted: sample ``sample_index`` of the
    ``group_size`` samples of prompt ``group_index`` of batch ``batch_id``. The batch is the
    unit of idempotent submission and of completion delivery; the group is what GRPO scores
    together. Records written before batches existed decode with ``batch_id`` "" (none)."""

    batch_id: str = ""
    group_index: int = 0
    sample_index: int = 0
    group_size: int = 1
    group_policy: GroupPolicy = GroupPolicy.SAMPLE

    def __post_init__(self) -> None:
        if not isinstance(self.batch_id, str):
            raise InvalidEvent(f"batch_id must be a string, got {self.batch_id!r}")
        for name in ("group_index", "sample_index", "group_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidEvent(f"{name} must be an int >= 0, got {v!r}")
        if self.group_size < 1 or self.sample_index >= self.group_size:
            raise InvalidEvent(
                f"sample {self.sample_index} of a group of {self.group_size} does not exist"
            )
        object.__setattr__(self, "group_policy", GroupPolicy(self.group_policy))

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "group_size": self.group_size,
            "group_policy": self.group_policy.value,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Submitted(Event):
    """``queue`` is the rq queue the rollout was submitted to: every later attempt (a requeue
    after a shutdown, a weight update, an engine error or a lost worker) goes back to it, so
    it runs on the workers, and so the model, it was submitted for."""

    request: RolloutRequest
    admitted_version: int = 0  # newest published weight version when it was submitted
    queue: str = DEFAULT_QUEUE
    membership: Membership = field(default_factory=Membership)

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        if not isinstance(self.queue, str) or not self.queue:
            raise InvalidEvent(f"queue must be a non-empty string, got {self.queue!r}")
        if not isinstance(self.membership, Membership):
            raise InvalidEvent("membership must be a Membership")


@dataclass(frozen=True, slots=True, kw_only=True)
class Started(Event):
    """The first attempt began on a worker, on weights ``weight_version``.

    ``weight_mode`` is how that worker's deployment handles weight updates during the attempt
    (abort, drain or keep), so the log says why versions do or do not change mid-attempt.
    ``model`` identifies the model the attempt runs (``workers.engines.identity``): every
    attempt of a rollout must run the same one, or its trajectory would mix two models.
    "" means unknown (records written before it was recorded)."""

    attempt: int
    worker_id: str
    weight_version: int
    weight_mode: str = "abort"
    model: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed(Event):
    """A later attempt began, continuing from the saved prefix (fields as in ``Started``)."""

    attempt: int
    worker_id: str
    weight_version: int
    weight_mode: str = "abort"
    model: str = ""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TokensAppended(Event):
    """New tokens of the current attempt, starting at ``offset`` of the response.

    ``weight_versions`` has one entry per token: the weights that sampled it.
    ``routed_experts`` is ``[tokens, moe_layers, top_k]`` for MoE models, else None.
    ``nonfinite_logprobs`` counts logprobs the engine returned as NaN/inf, which the worker
    stored as ``LOGPROB_FLOOR`` instead (so the trainer can tell a clamped value from a real one).
    ``top_token_ids``/``top_logprobs`` are ``[tokens, k]`` for a request with ``logprobs=k``:
    the k most likely tokens at each position, most likely first, and their raw logprobs (as
    vLLM's top-k list: the sampled token is among them when it ranks within k); both None
    when k is 0, which is what a record without them decodes as.

    ``observation_routes`` is set only on an episode turn's first chunk, when the engine
    returned the routes of that turn's prefill: ``[m, moe_layers, top_k]`` for the ``m`` tokens
    of the observation just before it (the last call's result), under ``routed_experts``' row
    convention (a token's row is the routing of the forward pass at the position before it).
    The first row is therefore the forward over the previous turn's last sampled token, and
    the routes of the chunk's own first token (the forward over the observation's last token)
    stay in ``routed_experts``: one row per context token, none twice. The turn's engine
    computed them all in its prefill, under the weights of the chunk's first token. None on
    every other chunk, and wherever the engine returns no prefill routes (the rows are then
    absent: ``RolloutState.context_routes``).
    """

    attempt: int
    offset: int
    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    weight_versions: npt.NDArray[np.int64]
    routed_experts: npt.NDArray[Any] | None = None
    nonfinite_logprobs: int = 0
    top_token_ids: npt.NDArray[np.int32] | None = None
    top_logprobs: npt.NDArray[np.float32] | None = None
    observation_routes: npt.NDArray[Any] | None = None

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        ids = frozen(self.token_ids, TOKEN_DTYPE, "token_ids")
        n = ids.shape[0]
        if n == 0:
            raise InvalidEvent("TokensAppended needs at least one token")
        if int(ids.min()) < 0:
            raise InvalidEvent("token ids must be >= 0")
        lps = frozen(self.logprobs, LOGPROB_DTYPE, "logprobs")
        vers = frozen(self.weight_versions, VERSION_DTYPE, "weight_versions")
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "logprobs", lps)
        object.__setattr__(self, "weight_versions", vers)
        if lps.shape[0] != n or vers.shape[0] != n:
            raise InvalidEvent(
                f"{n} token ids but {lps.shape[0]} logprobs and {vers.shape[0]} weight versions"
            )
        if self.routed_experts is not None:
            routes = frozen_routes(self.routed_experts)
            if routes.shape[0] != n:
                raise InvalidEvent(f"{n} token ids but {routes.shape[0]} routed-expert rows")
            object.__setattr__(self, "routed_experts", routes)
        if self.top_token_ids is not None or self.top_logprobs is not None:
            self._check_top(n)
        if self.observation_routes is not None:
            self._check_observation_routes()

    def _check_observation_routes(self) -> None:
        routes = frozen_routes(self.observation_routes, "observation_routes")
        if routes.shape[0] == 0:
            raise InvalidEvent("observation_routes needs a row per observation token (none given)")
        if self.routed_experts is not None and routes.shape[1:] != self.routed_experts.shape[1:]:
            raise InvalidEvent(
                f"observation_routes rows {routes.shape[1:]} but routed_experts rows "
                f"{self.routed_experts.shape[1:]}: one model has one [layers, top_k]"
            )
        object.__setattr__(self, "observation_routes", routes)

    def _check_top(self, n: int) -> None:
        if self.top_token_ids is None or self.top_logprobs is None:
            raise InvalidEvent("top_token_ids and top_logprobs come together or not at all")
        top_ids = frozen(self.top_token_ids, TOKEN_DTYPE, "top_token_ids", ndim=2)
        top_lps = frozen(self.top_logprobs, LOGPROB_DTYPE, "top_logprobs", ndim=2)
        if top_ids.shape != top_lps.shape or top_ids.shape[0] != n or top_ids.shape[1] < 1:
            raise InvalidEvent(
                f"{n} token ids but top_token_ids {top_ids.shape} and top_logprobs "
                f"{top_lps.shape}; both must be [{n}, k] with k >= 1"
            )
        if int(top_ids.min()) < 0:
            raise InvalidEvent("top token ids must be >= 0")
        object.__setattr__(self, "top_token_ids", top_ids)
        object.__setattr__(self, "top_logprobs", top_lps)

    @property
    def top_k(self) -> int:
        """How many alternatives each token carries (0: none recorded)."""
        return 0 if self.top_token_ids is None else int(self.top_token_ids.shape[1])

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokensAppended):
            return NotImplemented
        return (
            (self.rollout_id, self.seq, self.attempt, self.offset, self.nonfinite_logprobs)
            == (other.rollout_id, other.seq, other.attempt, other.offset, other.nonfinite_logprobs)
            and _same(self.token_ids, other.token_ids)
            # Compare logprobs bit for bit: NaN must equal NaN and -0.0 must not equal 0.0
            # for a round trip to count as exact.
            and self.logprobs.tobytes() == other.logprobs.tobytes()
            and _same(self.weight_versions, other.weight_versions)
            and _same(self.routed_experts, other.routed_experts)
            and _same(self.top_token_ids, other.top_token_ids)
            and _bits(self.top_logprobs) == _bits(other.top_logprobs)
            and _same(self.observation_routes, other.observation_routes)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted(Event):
    """The attempt stopped early; its appended tokens are kept."""

    attempt: int
    reason: AbortReason
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished(Event):
    """Generation ended for good. ``attempt`` is the attempt that ended it; 0 for an episode
    ended between turns by a budget, when no attempt is running (its fence: none live)."""

    attempt: int
    finish_reason: FinishReason
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed(Event):
    """Given up: ``attempts`` is how many attempts were made; ``failure`` says which kind of
    failure ended it (a request error is never retried; the others ran out of budget)."""

    error: str
    attempts: int
    failure: FailureClass = FailureClass.ENGINE_ERROR

    def __post_init__(self) -> None:
        Event.__post_init__(self)
        object.__setattr__(self, "failure", FailureClass(self.failure))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancelled(Event):
    reason: str = ""


def _bits(a: npt.NDArray[Any] | None) -> bytes | None:
    return None if a is None else a.tobytes()


def _same(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
