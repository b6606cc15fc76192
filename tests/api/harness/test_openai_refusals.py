"""What ``/v1/completions`` and ``/v1/chat/completions`` refuse: every field the engines cannot
serve (vLLM has it), unknown fields, more than one prompt; each a 422 in OpenAI's error body
whose ``param`` names the field, and nothing recorded. Against a real ``rollouts api``."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.conftest import Api

pytestmark = pytest.mark.slow
COMPLETION: dict[str, Any] = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}  # fmt: skip
REFUSED: list[tuple[str, str, Any]] = [
    ("completions", "echo", True),
    ("completions", "prompt_logprobs", 1),
    ("completions", "best_of", 2),
    ("completions", "suffix", "tail"),
    ("completions", "logit_bias", {"5": 1.0}),
    ("completions", "presence_penalty", 0.5),
    ("completions", "frequency_penalty", -0.5),
    ("completions", "repetition_penalty", 1.1),
    ("completions", "min_p", 0.1),
    ("completions", "response_format", {"type": "json_object"}),
    ("completions", "structured_outputs", {"regex": "a+"}),
    ("completions", "stream", True),
    ("completions", "stream_options", {"include_usage": True}),
    ("completions", "use_beam_search", True),
    ("completions", "include_stop_str_in_output", True),
    ("completions", "skip_special_tokens", False),
    ("completions", "allowed_token_ids", [1, 2]),
    ("completions", "bad_words", ["no"]),
    ("completions", "logprob_token_ids", [3]),
    ("completions", "truncate_prompt_tokens", 2),
    ("completions", "priority", 1),
    ("completions", "cache_salt", "salt"),
    ("completions", "vllm_xargs", {"a": 1}),
    ("completions", "kv_transfer_params", {"a": 1}),
    ("completions", "no_such_field", 1),  # unknown: never ignored
    ("completions", "prompt", [[5, 6], [7, 8]]),  # one prompt per call
    ("completions", "prompt", ["one", "two"]),
    ("completions", "logprobs", 21),  # over vLLM's default --max-logprobs
    ("completions", "n", 0),
    ("completions", "temperature", -1.0),
    ("completions", "top_k", -2),
    ("completions", "seed", -1),
    # This API's template (ChatML) renders no tools: refused, not dropped from the prompt.
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "auto"),  # without tools
    ("chat/completions", "tool_choice", "required"),  # needs guided decoding
    ("chat/completions", "continue_final_message", True),
    ("chat/completions", "echo", True),
    ("chat/completions", "chat_template", "{{ messages }}"),
    ("chat/completions", "top_logprobs", 3),  # without logprobs true
    ("chat/completions", "stream", True),
    ("chat/completions", "presence_penalty", 1.0),
    ("chat/completions", "no_such_field", "x"),
]


@pytest.mark.parametrize(("route", "field", "value"), REFUSED,
                         ids=[f"{r}-{f}-{v!r}"[:60] for r, f, v in REFUSED])  # fmt: skip
async def test_refused_by_name_and_nothing_recorded(
    api: Api, harness_redis: RedisServer, route: str, field: str, value: Any
) -> None:
    body = {**(COMPLETION if route == "completions" else CHAT), field: value}
    trainer = RolloutClient(harness_redis.url)
    before = await trainer.batches()
    async with aiohttp.ClientSession() as http, http.post(f"{api.v1}/{route}", json=body) as r:
        status, answer = r.status, await r.json()
    assert status == 422, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field and error["code"] == 422
    assert field in error["message"]
    assert await trainer.batches() == before
    await trainer.aclose()


async def test_neutral_values_of_unserved_fields_are_served(api: Api) -> None:
    """vLLM's defaults, as some harnesses send them all: served (each means "off")."""
    neutral = {"echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "min_p": 0,
               "repetition_penalty": 1.0, "logit_bias": None, "stream": False, "best_of": 1,
               "skip_special_tokens": True, "include_stop_str_in_output": False, "top_k": -1,
               "user": "someone", "suffix": None, "min_tokens": 0, "stop": None}  # fmt: skip
    body = {**COMPLETION, **neutral}
    async with aiohttp.ClientSession() as http, http.post(f"{api.v1}/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert len((await r.json())["choices"]) == 1


async def test_tools_on_a_template_that_renders_none_say_so(api: Api) -> None:
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}
    async with aiohttp.ClientSession() as http, http.post(f"{api.v1}/chat/completions",
                                                          json=body) as r:  # fmt: skip
        assert r.status == 422
        error = (await r.json())["error"]
    assert error["param"] == "tools"
    assert "chat template does not support tools" in error["message"]
