"""What a trainer asks for: a prompt given as token ids and vLLM-style sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from statemachine.checks import INT_MAX
from statemachine.checks import check_float as _check_float
from statemachine.checks import check_int as _check_int
from statemachine.checks import stop_strings as _stop_strings
from statemachine.checks import token_ids as _token_ids
from statemachine.episode import EpisodeSpec
from statemachine.errors import InvalidRequest

# Most top-k alternatives a request may ask per token (``SamplingParams.logprobs``): vLLM's
# default ``max_logprobs``, so every engine serves any k a request may hold.
MAX_LOGPROBS = 20

# The rq queue a rollout goes to when the submitter names none (``store.defaults.QUEUE_NAME``).
DEFAULT_QUEUE = "rollouts"

# Metadata is stored verbatim in the log and comes back with every result: plain msgpack data
# (strings, numbers, booleans, None, lists and string-keyed maps of them), so it can never
# smuggle objects (and so never needs pickle). Its size is capped at submit.
MetadataValue = Any
METADATA_DEPTH = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k (vLLM accepts 0 or -1; we normalise to 0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's ``logprobs=k``: besides the sampled token's logprob (always kept), the k most
    # likely tokens at each position and their logprobs, recorded per token (0: none).
    logprobs: int = 0
    # What to do when prompt + max_tokens exceeds the model's context (known only on the
    # worker): False fails the rollout at once with request_error; True generates what fits,
    # and the rollout may end with ``length`` before max_tokens.
    cap_to_context: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(
            self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, low=0.0, high=None)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos must be a bool")
        if not isinstance(self.cap_to_context, bool):
            raise InvalidRequest("cap_to_context must be a bool")
        _check_int("logprobs", self.logprobs, minimum=0)
        if self.logprobs > MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")

    def to_dict(self) -> dict[str, Any]:
        # cap_to_context only when set: records (and submit fingerprints) of requests that do
        # not use it stay byte for byte what they were before the field existed.
        capped = {"cap_to_context": True} if self.cap_to_context else {}
        return {
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            **capped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        if "max_tokens" not in data:
            raise InvalidRequest("sampling params need max_tokens")
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRequest:
    """One generation: a tokenized prompt and how to sample its continuation."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    group_id: str | None = None
    metadata: dict[str, MetadataValue] = field(default_factory=dict)
    # Do not start (or resume) this rollout once the weights are more than this many versions
    # ahead of the version it was admitted under; None: no bound.
    max_staleness: int | None = None
    # Set for a multi-turn episode: how a turn ends at a tool call, the tools and the
    # episode's budgets. None: a plain rollout, stored byte for byte as before episodes.
    episode: EpisodeSpec | None = None

    def __post_init__(self) -> None:
        ids = _token_ids("prompt_token_ids", self.prompt_token_ids)
        object.__setattr__(self, "prompt_token_ids", ids)
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest("sampling must be SamplingParams")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise InvalidRequest("group_id must be a string")
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, minimum=0)
        if not isinstance(self.metadata, dict):
            raise InvalidRequest("metadata must be a dict")
        if self.episode is not None and not isinstance(self.episode, EpisodeSpec):
            raise InvalidRequest("episode must be an EpisodeSpec")
        _check_metadata("metadata", self.metadata, 0)
        # As stored and read back: tuples become lists, so a retried submit compares equal.
        object.__setattr__(self, "metadata", _as_stored(self.metadata))

    __hash__ = None  # type: ignore[assignment]  # metadata is a dict: not hashable, by design

    def in_group(self, group_id: str) -> RolloutRequest:
        """This request with ``group_id``, without checking the rest again (it was checked when
        this one was built; a submit of 10,000 rollouts would check 640,000 token ids twice)."""
        if not isinstance(group_id, str):
            raise InvalidRequest("group_id must be a string")
        new = object.__new__(RolloutRequest)
        for f in fields(RolloutRequest):
            object.__setattr__(new, f.name, getattr(self, f.name))
        object.__setattr__(new, "group_id", group_id)
        return new

    def to_dict(self) -> dict[str, Any]:
        # episode only when set: a plain rollout's record (and submit fingerprint) stays byte
        # for byte what it was before episodes existed, as cap_to_context does.
        episode = {} if self.episode is None else {"episode": self.episode.to_dict()}
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "group_id": self.group_id,
            "metadata": dict(self.metadata),
            "max_staleness": self.max_staleness,
            **episode,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutRequest:
        unknown = set(data) - {
            "prompt_token_ids",
            "sampling",
            "group_id",
            "metadata",
            "max_staleness",
            "episode",
        }
        if unknown:
            raise InvalidRequest(f"unknown request field(s): {sorted(unknown)}")
        try:
            sampling = SamplingParams.from_dict(dict(data["sampling"]))
            episode = data.get("episode")
            return cls(
                prompt_token_ids=data["prompt_token_ids"],
                sampling=sampling,
                group_id=data.get("group_id"),
                metadata=dict(data.get("metadata") or {}),
                max_staleness=data.get("max_staleness"),
                episode=None if episode is None else EpisodeSpec.from_dict(dict(episode)),
            )
        except KeyError as exc:
            raise InvalidRequest(f"request is missing {exc.args[0]!r}") from None
        except TypeError as exc:
            # A wrong container type (e.g. a number where a list belongs) surfaces here.
            raise InvalidRequest(f"malformed request: {exc}") from None


def _check_metadata(where: str, value: object, depth: int) -> None:
    if depth > METADATA_DEPTH:
        raise InvalidRequest(f"{where}: nested deeper than {METADATA_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRequest(f"{where}: keys must be strings, got {k!r}")
            _check_metadata(f"{where}.{k}", v, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_metadata(f"{where}[{i}]", v, depth + 1)
    elif (
        isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value <= INT_MAX
    ):
        raise InvalidRequest(f"{where}: {value} does not fit in 64 bits")
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{where}: {value!r} is not finite")
    elif not isinstance(value, str | int | float | bool | None):
        raise InvalidRequest(
            f"{where}: must be str/int/float/bool/None or lists and maps of them, "
            f"got {type(value).__name__}"
        )


def _as_stored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_stored(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_stored(v) for v in value]
    return value
