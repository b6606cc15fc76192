"""Chat with tools, as vLLM serves it with ``--enable-auto-tool-choice --tool-call-parser
hermes``: the tools and the messages of earlier turns (an assistant's ``tool_calls``, ``tool``
messages) rendered by the API's chat template, and the answer's text parsed for calls
(``tool_parser``).

Served only where the template renders tools: ``renders_tools`` renders a probe tool once at
start-up and looks for its name in the text (a template that ignores ``tools``, ChatML's
plain one, would otherwise drop them silently from every prompt). ``tool_choice`` is "auto"
(the default with tools) or "none" (the text is not parsed); "required" and a named function
would need guided decoding to be honest and are refused (``openai_api.REFUSED``).
"""

from __future__ import annotations

import json
from typing import Any

from store import tool_parser
from store.results import RolloutResult

from ..errors import ApiError
from . import openai_schemas as s

_PROBE = "durable_rollouts_probe_tool"
NO_TOOLS = "the model's chat template does not support tools (it renders no tool given to it)"


def renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template puts the tools it is given into the prompt."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": None,
                                               "parameters": None}}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=probe, add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip
    # Any refusal of the template (none set, a template that raises on tools) means no.
    except Exception:
        return False
    return isinstance(text, str) and _PROBE in text


def choice(body: s.ChatCompletionRequest, served: bool) -> str | None:
    """The call's tool choice: "auto" or "none" with tools, None without; 422 for tools this
    API's template cannot render."""
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise ApiError(422, "invalid_request", "tool_choice: when using tool_choice, tools "
                           "must be set", "tool_choice")  # fmt: skip
        return None
    if not served:
        raise ApiError(422, "unsupported_field", f"tools: {NO_TOOLS}", "tools")
    return body.tool_choice or "auto"


def tool_dicts(body: s.ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the template gets them: vLLM's ``tool.model_dump()`` (description and
    parameters kept when null, ``strict`` only when set)."""
    if body.tools is None:
        return None
    return [{"type": t.type, "function": t.function.model_dump(exclude={"strict"} if
             t.function.strict is None else set())} for t in body.tools]  # fmt: skip


def messages(body: s.ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template gets them, as vLLM's renderer passes them: text parts
    joined, null content as "", an assistant's calls with their arguments as objects (chat
    templates expect them so; vLLM parses the JSON text, and text that is not an object
    becomes {}), a tool message's ``tool_call_id``."""
    out = []
    for m in body.messages:
        content = m.content
        if content is None:
            content = ""
        elif not isinstance(content, str):
            content = "".join(p.text for p in content)
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:  # [] is dropped, as vLLM drops it: the plain assistant path
            message["tool_calls"] = [_called(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def prompt_ids(tokenizer: Any, body: s.ChatCompletionRequest) -> list[int]:
    """The call's prompt: its messages and tools through ``tokenizer``'s chat template; 422
    when the template refuses them."""
    tools = tool_dicts(body)
    try:
        ids = tokenizer.apply_chat_template(
            messages(body), add_generation_prompt=body.add_generation_prompt,
            tokenize=True, **({"tools": tools} if tools else {}),
            **(body.chat_template_kwargs or {}),
        )  # fmt: skip
    except Exception as exc:  # a template's refusal is the caller's
        raise ApiError(422, "invalid_request", f"messages: the chat template refused "
                       f"them: {exc}", "messages") from None  # fmt: skip
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _called(call: s.ChatMessageToolCall) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        # vLLM's choice: a malformed call in the history must not fail every later turn.
        except ValueError:
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": arguments}}  # fmt: skip


def answer_text(r: RolloutResult, tokenizer: Any) -> str:
    """The text the parser reads, as vLLM's: special tokens kept (a model may mark its calls
    with special tokens; vLLM's hermes parser turns ``skip_special_tokens`` off), the stop
    token that ended the answer left out (vLLM's detokenizer never shows it)."""
    ids = r.response_token_ids.tolist()
    ended_by_token = r.finish_reason is not None and r.finish_reason.value == "stop" and (
        not isinstance(r.stop_reason, str))  # fmt: skip
    if ended_by_token and ids:
        ids = ids[:-1]
    text: str = tokenizer.decode(ids, skip_special_tokens=False)
    return text


def message(
    r: RolloutResult, tokenizer: Any, tool_choice: str | None, parallel: bool | None
) -> tuple[dict[str, Any], bool]:
    """The answer's message and whether it called tools. Without tools, or with
    ``tool_choice`` "none", the text as it is; with "auto", parsed (``tool_parser``);
    ``parallel`` false keeps the first call only (vLLM's ``maybe_filter_parallel_tool_calls``)."""
    if tool_choice != "auto" or tokenizer is None:
        return {"role": "assistant", "content": r.text or "", "tool_calls": []}, False
    parsed = tool_parser.parse(answer_text(r, tokenizer))
    calls = parsed.calls[:1] if parallel is False else parsed.calls
    ids = tool_parser.call_ids(r.rollout_id, len(calls))
    out = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
           for i, c in zip(ids, calls, strict=True)]  # fmt: skip
    return {"role": "assistant", "content": parsed.content, "tool_calls": out}, bool(out)
