"""What a trainer asks for: a prompt given as token ids and vLLM-style sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from statemachine.errors import InvalidRequest

# Metadata is stored verbatim in the log; keep it to plain msgpack-able scalars so it
# can never smuggle objects (and so never needs pickle).
MetadataValue = str | int | float | bool | None


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
    logprobs: int = 0  # extra top-k logprobs asked of the engine; the sampled one is always kept

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a sequence of non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos must be a bool")
        _check_int("logprobs", self.logprobs, minimum=0)

    def to_dict(self) -> dict[str, Any]:
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

    def __post_init__(self) -> None:
        ids = tuple(self.prompt_token_ids)
        object.__setattr__(self, "prompt_token_ids", ids)
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        for t in ids:
            _check_int("prompt_token_ids[]", t, minimum=0)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest("sampling must be SamplingParams")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise InvalidRequest("group_id must be a string")
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, minimum=0)
        if not isinstance(self.metadata, dict):
            raise InvalidRequest("metadata must be a dict")
        for k, v in self.metadata.items():
            if not isinstance(k, str) or not isinstance(v, str | int | float | bool | None):
                raise InvalidRequest(
                    f"metadata must map strings to str/int/float/bool/None, got {k!r}: {v!r}"
                )

    __hash__ = None  # type: ignore[assignment]  # metadata is a dict: not hashable, by design

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "group_id": self.group_id,
            "metadata": dict(self.metadata),
            "max_staleness": self.max_staleness,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutRequest:
        unknown = set(data) - {
            "prompt_token_ids",
            "sampling",
            "group_id",
            "metadata",
            "max_staleness",
        }
        if unknown:
            raise InvalidRequest(f"unknown request field(s): {sorted(unknown)}")
        try:
            sampling = SamplingParams.from_dict(dict(data["sampling"]))
            return cls(
                prompt_token_ids=tuple(data["prompt_token_ids"]),
                sampling=sampling,
                group_id=data.get("group_id"),
                metadata=dict(data.get("metadata") or {}),
                max_staleness=data.get("max_staleness"),
            )
        except KeyError as exc:
            raise InvalidRequest(f"request is missing {exc.args[0]!r}") from None
        except TypeError as exc:
            # A wrong container type (e.g. a number where a list belongs) surfaces here.
            raise InvalidRequest(f"malformed request: {exc}") from None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; True as a token id or a budget is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}")


def _check_float(
    name: str, value: object, *, low: float, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or (low_open and v <= low) or v < low or (high is not None and v > high):
        bound = (
            f"({low}, {high}]" if low_open else f"[{low}, {high if high is not None else 'inf'})"
        )
        raise InvalidRequest(f"{name} must be in {bound}, got {value!r}")
