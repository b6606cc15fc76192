"""The Hermes tool-call parser on text, case by case as vLLM 0.32's ``hermes`` parser reads it
(``extract_tool_calls``): one call, two, content before them, an unclosed last call, malformed
JSON and calls without a name staying content, no calls at all; and the answer's ids."""

from __future__ import annotations

import json

import pytest

from store import tool_parser
from store.tool_parser import Parsed, ParsedCall

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_one_call_is_a_call_and_no_content() -> None:
    assert tool_parser.parse(CALL) == Parsed(None, (ParsedCall("add", '{"a": 1, "b": 2}'),))


def test_two_calls_in_order_with_the_text_before_as_content() -> None:
    second = '<tool_call>{"name": "échelle", "arguments": {"x": "ü", "n": [1, {}]}}</tool_call>'
    parsed = tool_parser.parse("Let me add.\n" + CALL + "\n" + second + " trailing")
    assert parsed.content == "Let me add.\n"  # the text after the calls is dropped, as vLLM's
    assert [c.name for c in parsed.calls] == ["add", "échelle"]
    # Arguments are JSON text again, non-ASCII kept as is (vLLM's ensure_ascii=False).
    assert parsed.calls[1].arguments == '{"x": "ü", "n": [1, {}]}'
    assert json.loads(parsed.calls[0].arguments) == {"a": 1, "b": 2}


def test_an_unclosed_last_call_is_read_to_the_end() -> None:
    parsed = tool_parser.parse(CALL + '<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in parsed.calls] == ["add", "f"]
    assert parsed.calls[1].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # bad JSON
        CALL + '<tool_call>{"name": "f", "arguments"</tool_call>',  # one bad: none is kept
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is no string
        '<tool_call>["add", {}]</tool_call>',  # not an object
        "<tool_call></tool_call>",
        "Sure: <tool_call>",
    ],
)
def test_malformed_calls_stay_content(text: str) -> None:
    assert tool_parser.parse(text) == Parsed(text, ())


@pytest.mark.parametrize("text", ["", "The answer is 3.", "a </tool_call> alone", "<tool"])
def test_no_calls(text: str) -> None:
    assert tool_parser.parse(text) == Parsed(text, ())


def test_ids_are_openais_form_and_the_same_for_the_same_rollout() -> None:
    ids = tool_parser.call_ids("call-abc.0.0", 3)
    assert len(set(ids)) == 3
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    int(ids[0].removeprefix("call_"), 16)  # hex
    assert tool_parser.call_ids("call-abc.0.0", 2) == ids[:2]
    assert tool_parser.call_ids("call-abc.0.1", 1) != ids[:1]
