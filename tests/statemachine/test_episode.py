"""An episode's spec: checked like sampling params (each bad field named), stored only when
set, so a plain request's record is what it always was."""

from __future__ import annotations

from typing import Any

import pytest

from statemachine import (
    EpisodeSpec,
    InvalidRequest,
    RolloutRequest,
    SamplingParams,
    ToolEffect,
    ToolSpec,
)
from tests import factories as f


def test_a_spec_normalises_what_it_is_given() -> None:
    spec = EpisodeSpec(
        tool_call_stop_strings="</tool_call>",
        tool_call_stop_token_ids=[7, 8],
        tools=[{"name": "calc", "effect": "idempotent"}, ToolSpec(name="send")],
        max_tool_seconds=3,
    )
    assert spec.tool_call_stop_strings == ("</tool_call>",)  # one string, not its letters
    assert spec.tool_call_stop_token_ids == (7, 8)
    assert spec.tools == (
        ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),
        ToolSpec(name="send", effect=ToolEffect.RESTART),
    )
    assert spec.max_tool_seconds == 3.0 and isinstance(spec.max_tool_seconds, float)
    assert EpisodeSpec(parser="hermes").parser == "hermes"


def test_a_tool_not_declared_is_treated_as_restart() -> None:
    spec = f.episode()
    assert spec.effect_of("calc") is ToolEffect.IDEMPOTENT
    assert spec.effect_of("edit") is ToolEffect.RESTORE
    assert spec.effect_of("send") is ToolEffect.RESTART
    assert spec.effect_of("rm -rf") is ToolEffect.RESTART


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "tool_call_stop_token_ids, tool_call_stop_strings or a parser"),
        ({"parser": ""}, "parser"),
        ({"parser": 3}, "parser"),
        ({"tool_call_stop_token_ids": [-1]}, "tool_call_stop_token_ids"),
        ({"tool_call_stop_token_ids": "7"}, "tool_call_stop_token_ids"),
        ({"tool_call_stop_strings": ["a", ""]}, "tool_call_stop_strings"),
        ({"tools": "calc"}, "tools"),
        ({"tools": [{"name": "a"}, {"name": "a"}]}, "declared twice"),
        ({"tools": [{"name": ""}]}, "tool name"),
        ({"tools": [{"effect": "restart"}]}, "needs a name"),
        ({"tools": [{"name": "a", "effect": "maybe"}]}, "effect"),
        ({"tools": [{"name": "a", "cost": 1}]}, "unknown tool field"),
        ({"tools": [3]}, "ToolSpec or a dict"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"max_total_tokens": 0}, "max_total_tokens"),
        ({"max_tool_seconds": 0}, "max_tool_seconds"),
        ({"max_tool_seconds": float("inf")}, "max_tool_seconds"),
        ({"max_wall_seconds": -1.0}, "max_wall_seconds"),
        ({"max_wall_seconds": "60"}, "max_wall_seconds"),
        ({"env_queue": ""}, "env_queue"),
        ({"env_queue": "a b"}, "env_queue"),
        ({"env_queue": "a:b"}, "env_queue"),
        ({"env_queue": "{a}"}, "env_queue"),
        ({"env_queue": "x" * 161}, "env_queue"),
        ({"env_queue": 3}, "env_queue"),
    ],
)
def test_bad_episode_values_are_refused_by_name(kwargs: dict[str, Any], field: str) -> None:
    # A parser makes the spec valid but for the field under test.
    base: dict[str, Any] = {} if not kwargs or "parser" in kwargs else {"parser": "p"}
    with pytest.raises(InvalidRequest, match=field):
        EpisodeSpec(**{**base, **kwargs})


def test_a_request_stores_its_episode_only_when_it_has_one() -> None:
    plain = f.request()
    assert "episode" not in plain.to_dict()
    request = RolloutRequest(
        prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=8), episode=f.episode()
    )
    data = request.to_dict()
    assert data["episode"]["tools"][0] == {"name": "calc", "effect": "idempotent"}
    assert RolloutRequest.from_dict(data) == request
    with pytest.raises(InvalidRequest, match="unknown episode field"):
        RolloutRequest.from_dict({**data, "episode": {**data["episode"], "turns": 3}})
    with pytest.raises(InvalidRequest, match="episode must be an EpisodeSpec"):
        RolloutRequest(prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=1), episode={})  # type: ignore[arg-type]


def test_env_queue_defaults_and_round_trips_and_old_dicts_read_as_default() -> None:
    spec = EpisodeSpec(parser="p", env_queue="sandbox.v2")
    assert EpisodeSpec.from_dict(spec.to_dict()) == spec
    # A spec stored before the field existed has no key: it reads as the default queue.
    old = {k: v for k, v in spec.to_dict().items() if k != "env_queue"}
    assert EpisodeSpec.from_dict(old).env_queue == "default"
