"""Chat tools without processes (``store/api/harness/chat_tools.py``) over the tiny tokenizer:
which templates render tools, the messages as the template gets them (arguments as objects,
malformed ones as {}), the text the parser reads (special tokens kept, the stop token left out)
and the answer's message (``parallel_tool_calls`` false, ``tool_choice`` none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from statemachine import FinishReason, Status
from store.api.harness import chat_tools
from store.api.harness import openai_schemas as s
from store.results import RolloutResult
from tests.api.harness.conftest import CHAT_TEMPLATE
from workers.demo.tiny_tokenizer import TOOL_CHAT_TEMPLATE, make_tiny_tokenizer

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_tokenizer(tmp_path_factory.mktemp("t"), chat_template=TOOL_CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(path)


def answer(tok: Any, text: str, *, stop: bool = True, rid: str = "b.0.0") -> RolloutResult:
    ids = tok.encode(text, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*ids, end] if stop else ids
    return RolloutResult(
        rollout_id=rid, status=Status.DONE, prompt_token_ids=(1,),
        response_token_ids=np.asarray(ids, np.int32), logprobs=np.zeros(len(ids), np.float32),
        weight_versions=np.zeros(len(ids), np.int64), routed_experts=None,
        finish_reason=FinishReason.STOP if stop else FinishReason.LENGTH,
        stop_reason=end if stop else None, text=tok.decode(ids, skip_special_tokens=True),
        error=None, attempts=1, aborts=0, nonfinite_logprobs=0, group_id=None, metadata={},
    )  # fmt: skip


def test_which_templates_render_tools(tok: Any, tmp_path: Path) -> None:
    assert chat_tools.renders_tools(tok)
    chatml = make_tiny_tokenizer(tmp_path / "c", chat_template=CHAT_TEMPLATE)
    assert not chat_tools.renders_tools(AutoTokenizer.from_pretrained(chatml))
    bare = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "b"))  # no template
    assert not chat_tools.renders_tools(bare)


def test_messages_as_the_template_gets_them() -> None:
    body = s.ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{oops"}},
            {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
            {"id": "c4", "type": "function", "function": {"name": "k", "arguments": {"y": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ], "tools": [{"type": "function", "function": {"name": "f"}}]})  # fmt: skip
    user, called, tool, plain = chat_tools.messages(body)
    assert user == {"role": "user", "content": "ab"}
    assert called["content"] == ""
    assert [c["function"]["arguments"] for c in called["tool_calls"]] == [
        {"x": 1}, {}, {}, {"y": 2}]  # fmt: skip
    assert tool == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert plain == {"role": "assistant", "content": "done"}  # [] dropped, as vLLM does
    function = {"name": "f", "description": None, "parameters": None}
    assert chat_tools.tool_dicts(body) == [{"type": "function", "function": function}]


def test_the_parsed_text_keeps_special_tokens_but_not_the_stop_token(tok: Any) -> None:
    r = answer(tok, "<|im_start|>" + CALL)
    assert chat_tools.answer_text(r, tok) == "<|im_start|>" + CALL
    # Ended by length: nothing is a stop token.
    assert chat_tools.answer_text(answer(tok, CALL, stop=False), tok) == CALL


def test_the_answers_message(tok: Any) -> None:
    two = answer(tok, "Hm. " + CALL + CALL)
    message, called = chat_tools.message(two, tok, "auto", None)
    assert called and message["content"] == "Hm. " and len(message["tool_calls"]) == 2
    first, _ = chat_tools.message(two, tok, "auto", False)
    assert first["tool_calls"] == message["tool_calls"][:1]
    again, _ = chat_tools.message(two, tok, "auto", None)
    assert again == message  # the same ids for the same rollout
    plain, called = chat_tools.message(two, tok, "none", None)
    assert not called and plain == {"role": "assistant", "content": "Hm. " + CALL + CALL,
                                    "tool_calls": []}  # fmt: skip
    text, called = chat_tools.message(answer(tok, "3"), tok, "auto", None)
    assert not called and text["content"] == "3" and text["tool_calls"] == []
