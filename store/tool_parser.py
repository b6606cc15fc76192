"""Tool calls read out of a chat answer's text, as vLLM 0.32's ``hermes`` tool parser reads them
(``vllm/tool_parsers/hermes_tool_parser.py``, ``extract_tool_calls``): Qwen's and Hermes's
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Followed exactly, so that a harness gets from this API what vLLM started with
``--tool-call-parser hermes`` would give it for the same tokens:

- no ``<tool_call>`` in the text: no calls, the text is the content;
- else every ``<tool_call>(.*?)</tool_call>`` and a last unclosed ``<tool_call>(.*)`` is read
  as JSON; ``arguments`` becomes a JSON string again (``ensure_ascii=False``, vLLM's
  ``json.dumps``), and the content is the text before the first ``<tool_call>`` (None when
  empty: the text after the last call is dropped, as vLLM drops it);
- one call that does not parse (bad JSON, no ``name`` or ``arguments``) and none is returned:
  the whole text stays content, as vLLM's ``except`` branch does.

Pure: no I/O, no tokenizer. The ids the answer gives each call are ``call_ids``'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

START = "<tool_call>"
END = "</tool_call>"
# vLLM's regex: a closed call, or an unclosed one running to the end of the text.
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON text, as OpenAI's ``function.arguments``


@dataclass(frozen=True, slots=True)
class Parsed:
    """What an answer's text says: its content (None when all of it was calls) and calls."""

    content: str | None
    calls: tuple[ParsedCall, ...]


def parse(text: str) -> Parsed:
    """The tool calls of ``text`` (see the module's docstring for every rule)."""
    if START not in text:
        return Parsed(text, ())
    try:
        raw = [json.loads(closed or unclosed) for closed, unclosed in _CALL.findall(text)]
        calls = tuple(_call(c) for c in raw)
    # vLLM's catch-all, narrowed to what these lines raise: bad JSON, a call that is not an
    # object (TypeError on indexing), lacks a field or names itself with no string (vLLM's
    # ``FunctionCall`` refuses it). The text stays content.
    except (ValueError, TypeError, KeyError):
        return Parsed(text, ())
    content = text[: text.find(START)]
    return Parsed(content or None, calls)


def _call(c: dict[str, object]) -> ParsedCall:
    name = c["name"]
    if not isinstance(name, str):
        raise TypeError(f"a tool call's name is not a string: {name!r}")
    return ParsedCall(name, json.dumps(c["arguments"], ensure_ascii=False))


def call_ids(rollout_id: str, count: int) -> list[str]:
    """The ids of a rollout's ``count`` parsed calls: ``call_<24 hex>``, derived from the
    rollout, so a retried call (attached to the same rollout) answers the same ids."""
    return [
        "call_" + hashlib.sha256(f"{rollout_id}\0{i}".encode()).hexdigest()[:24]
        for i in range(count)
    ]
