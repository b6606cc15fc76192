"""What a submission says about a multi-turn episode: how a turn ends at a tool call, which
tools it may call and what recovery may do with each, and the episode's budgets.

An episode is one rollout whose generation stops at tool calls: an environment runs each
call and its output (as the tokens the engine is fed) is recorded before the next turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from statemachine.checks import check_float, check_int, stop_strings, token_ids
from statemachine.errors import InvalidRequest

DEFAULT_ENV_QUEUE = "default"
MAX_ENV_QUEUE_LEN = 160
# What store/keys.py allows in an id that names a key: its ID_CHARS, character for character
# (tests/store/test_episode_store.py holds them equal). A looser rule here let a submit take a
# queue name (with U+FEFF, say) that the worker's append then refused, mid-episode.
ENV_QUEUE_CHARS = (
    r"[^{}:\u0000-\u0020\u007f-\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
    r"\ufeff]"
)
_ENV_QUEUE = re.compile(rf"{ENV_QUEUE_CHARS}{{1,{MAX_ENV_QUEUE_LEN}}}")


class ToolEffect(StrEnum):
    """What recovery does with a call whose effect is unverified (its runner was lost after
    the call was claimed and before a result was recorded): whether it took effect is unknown."""

    IDEMPOTENT = "idempotent"  # running it twice is the same as once: run it again
    RESTORE = "restore"  # restore the environment to the last recorded revision, then run it
    RESTART = "restart"  # neither is safe: the episode fails, saying so


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    name: str
    effect: ToolEffect = ToolEffect.RESTART

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest(f"tool name must be a non-empty string, got {self.name!r}")
        try:
            object.__setattr__(self, "effect", ToolEffect(self.effect))
        except ValueError:
            raise InvalidRequest(
                f"tool {self.name!r}: effect must be one of "
                f"{[e.value for e in ToolEffect]}, got {self.effect!r}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "effect": self.effect.value}


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeSpec:
    """``tool_call_stop_token_ids``/``tool_call_stop_strings`` end a turn at a tool call the way
    ``stop``/``stop_token_ids`` end a rollout; ``parser`` names a parser of the model's
    tool-call syntax (the domain only stores the name; workers resolve it). At least one of
    the three is needed, or no turn could ever end at a tool call.

    Budgets, each optional (None: no bound) and each ending the episode with a finish reason
    of its own: ``max_turns`` generation turns; ``max_total_tokens`` sampled plus observation
    tokens (the context the episode grows, prompt excluded); ``max_tool_seconds`` summed over
    the calls' recorded run times; ``max_wall_seconds`` from submission. The request's
    ``max_tokens`` stays the budget of sampled tokens over the whole episode.

    ``env_queue`` names the environment queue its tool calls wait on: the runners that serve
    that queue (a sandbox image, a set of tools) claim them. It names a Redis key, so it
    follows the rules of a batch id (no braces, colons, whitespace or control characters).

    ``harness``: the turns are driven by whoever calls (a harness running its own tools, each
    of its calls one turn: ``store.harness_turns``), not by tool-call stops. Every end of a
    turn's generation (a stop, eos, the call's ``max_tokens``) ends the turn and the episode
    waits for the next call, which feeds the tokens its prompt adds and its own sampling
    (``TurnRequested``). Such an episode has no tool-call stops, parser or tools."""

    tool_call_stop_token_ids: tuple[int, ...] = ()
    tool_call_stop_strings: tuple[str, ...] = ()
    parser: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    max_turns: int | None = None
    max_total_tokens: int | None = None
    max_tool_seconds: float | None = None
    max_wall_seconds: float | None = None
    env_queue: str = DEFAULT_ENV_QUEUE
    harness: bool = False

    def __post_init__(self) -> None:
        ids = token_ids("tool_call_stop_token_ids", self.tool_call_stop_token_ids)
        object.__setattr__(self, "tool_call_stop_token_ids", ids)
        strings = _named_stop_strings(self.tool_call_stop_strings)
        object.__setattr__(self, "tool_call_stop_strings", strings)
        if self.parser is not None and (not isinstance(self.parser, str) or not self.parser):
            raise InvalidRequest(f"parser must be a non-empty string, got {self.parser!r}")
        if not isinstance(self.harness, bool):
            raise InvalidRequest(f"harness must be a bool, got {self.harness!r}")
        if self.harness and (ids or strings or self.parser is not None or self.tools):
            raise InvalidRequest(
                "a harness-driven episode has no tool-call stops, parser or tools: its "
                "harness ends each turn by calling again"
            )
        if not ids and not strings and self.parser is None and not self.harness:
            raise InvalidRequest(
                "episode needs tool_call_stop_token_ids, tool_call_stop_strings or a parser: "
                "without one no turn can end at a tool call"
            )
        object.__setattr__(self, "tools", _tools(self.tools))
        _check_env_queue(self.env_queue)
        for name in ("max_turns", "max_total_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        for name in ("max_tool_seconds", "max_wall_seconds"):
            value = getattr(self, name)
            if value is not None:
                # Zero would end every episode before its first step: never what was meant.
                check_float(name, value, low=0.0, high=None, low_open=True)
                object.__setattr__(self, name, float(value))

    def effect_of(self, name: str) -> ToolEffect:
        """The declared effect of tool ``name``; ``restart`` for a tool not declared: nothing
        is known about it, so the only safe recovery is not to run it again."""
        for tool in self.tools:
            if tool.name == name:
                return tool.effect
        return ToolEffect.RESTART

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool_call_stop_token_ids": list(self.tool_call_stop_token_ids),
            "tool_call_stop_strings": list(self.tool_call_stop_strings),
            "parser": self.parser,
            "tools": [t.to_dict() for t in self.tools],
            "max_turns": self.max_turns,
            "max_total_tokens": self.max_total_tokens,
            "max_tool_seconds": self.max_tool_seconds,
            "max_wall_seconds": self.max_wall_seconds,
            "env_queue": self.env_queue,
            # Only when set: an environment episode's record stays what it was, and code that
            # predates harness-driven episodes refuses one's (an unknown field).
            **({"harness": True} if self.harness else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeSpec:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown episode field(s): {sorted(unknown)}")
        return cls(**data)


def _named_stop_strings(value: object) -> tuple[str, ...]:
    # The checks of ``stop`` (a lone string is one stop string), with this field's name.
    try:
        return stop_strings(value) if value else ()
    except InvalidRequest:
        raise InvalidRequest(
            f"tool_call_stop_strings must be a string or a list of non-empty strings, got {value!r}"
        ) from None


def _tools(value: object) -> tuple[ToolSpec, ...]:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"tools must be a list of tools, got {type(value).__name__}")
    tools: list[ToolSpec] = []
    for item in value:
        if isinstance(item, dict):
            unknown = set(item) - {"name", "effect"}
            if unknown:
                raise InvalidRequest(f"unknown tool field(s): {sorted(unknown)}")
            if "name" not in item:
                raise InvalidRequest(f"a tool needs a name, got {item!r}")
            item = ToolSpec(**item)
        if not isinstance(item, ToolSpec):
            raise InvalidRequest(f"a tool must be a ToolSpec or a dict, got {item!r}")
        tools.append(item)
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        # Recovery looks a tool up by name: two declarations could disagree on its effect.
        raise InvalidRequest(f"tools declared twice: {duplicates}")
    return tuple(tools)


def _check_env_queue(value: object) -> None:
    if not isinstance(value, str) or _ENV_QUEUE.fullmatch(value) is None:
        raise InvalidRequest(
            f"env_queue must be 1-{MAX_ENV_QUEUE_LEN} characters without braces, colons, "
            f"whitespace or control characters, got {value!r}"
        )
