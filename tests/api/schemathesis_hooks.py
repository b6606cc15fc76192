"""Hooks of the schemathesis run of the served document (``test_schemathesis.py``), which the
``schemathesis`` CLI imports through ``SCHEMATHESIS_HOOKS``.

- msgpack answers are read back (bytes as the base64 the document describes). Request bodies
  go as JSON only: msgpack cannot carry the integers beyond 64 bits that negative cases hold
  (msgpack request bodies are covered by ``test_openapi.py`` and ``test_endpoints.py``).
- result streams (NDJSON, one result per line): the first line is what the response-schema
  check sees; ``every_stream_line_as_documented`` checks every line.
- a stream waits until its batch is delivered or its ``timeout``: a valid one is shortened
  to ``STREAM_S`` so that the run never waits on a batch that no worker runs; so is a valid
  claim's ``timeout_s`` (an empty environment queue answers 204 after it).
- generation is kept small in a valid body, whatever its operation: at most ``CAPS`` samples
  (``n``) and tokens (``max_tokens``, ``max_completion_tokens``; ``min_tokens`` within them),
  so that the synthetic worker answers every call (which waits for its rollouts) well within
  the run's request timeout, and the rollouts of a submit do not hold the calls behind them.
  The price: the largest valid values (1,024 samples, 100,000 rollouts a submit) are not
  sent; values beyond them still are (a negative case is sent as generated).
- token ids are kept within the worker's model's vocabulary (``VOCAB``), which the document
  cannot state (it is the worker's, not the API's): the worker refuses others (400).
- a call's prompt is kept within the worker's context (``SCHEMATHESIS_CONTEXT``), which the
  document cannot state either: the worker refuses a prompt that leaves no room (400). Token
  ids are cut; text and chat are measured as the API measures them (its tokenizer,
  ``SCHEMATHESIS_TOKENIZER``, and its chat rendering, ``chat_tools.prompt_ids``) and cut
  (the last messages and tools dropped first) only when they do not fit.
- the constraints JSON Schema cannot state (each said in the document's descriptions), met by
  the bodies generated as valid, and only those: ``sampling`` as a list has one entry per
  prompt; ``ids`` name prompts x n distinct rollouts; at most 100,000 rollouts;
  ``min_tokens`` <= ``max_tokens``; metadata packs into 4,096 bytes; an episode's tools
  named once each.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any

import jsonschema_rs
import msgpack
import schemathesis
from schemathesis import GenerationMode

from store import defaults
from store.api.errors import ApiError
from store.api.harness import chat_tools
from store.api.harness.openai_schemas import ChatCompletionRequest

STREAM_S = 0.3
CAPS = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8}
VOCAB = 32_000  # the synthetic engine's (its default)
TOKEN_ID_KEYS = frozenset(
    {"prompt_token_ids", "prompt", "token_ids", "stop_token_ids", "tool_call_stop_token_ids"}
)
# The worker's context, and the API's tokenizer (loaded here, before the run's clock starts).
CONTEXT = int(os.environ.get("SCHEMATHESIS_CONTEXT", "0")) or None
TOKENIZER: Any = None
if os.environ.get("SCHEMATHESIS_TOKENIZER"):
    from transformers import AutoTokenizer

    TOKENIZER = AutoTokenizer.from_pretrained(
        os.environ["SCHEMATHESIS_TOKENIZER"], local_files_only=True
    )
PLAIN_MESSAGES = [{"role": "user", "content": ""}]
PLAIN_TOOLS = [{"type": "function", "function": {"name": "f"}}]
NDJSON = "application/x-ndjson"
MSGPACK = "application/msgpack"


def _json_view(value: Any) -> Any:
    """A msgpack value as the document describes it in JSON: bytes as base64."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {k: _json_view(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_view(v) for v in value]
    return value


def _lines(content_type: str, content: bytes) -> list[Any]:
    if content_type.startswith(MSGPACK):
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(content)
        return [_json_view(v) for v in unpacker]
    return [json.loads(line) for line in content.splitlines() if line.strip()]


@schemathesis.deserializer(MSGPACK)
def _msgpack_answer(ctx: Any, response: Any) -> Any:
    values = _lines(MSGPACK, response.content)
    return values[0] if values else None


@schemathesis.deserializer(NDJSON)
def _ndjson_answer(ctx: Any, response: Any) -> Any:
    values = _lines(NDJSON, response.content)
    return values[0] if values else None


@schemathesis.check
def every_stream_line_as_documented(ctx: Any, response: Any, case: Any) -> bool | None:
    """Each line of a result stream is a ``Result`` or a ``StreamError``, as documented."""
    ctype = (response.headers.get("content-type") or [""])[0]
    if response.status_code != 200 or not ctype.startswith((NDJSON, MSGPACK)):
        return None
    document = case.operation.schema.raw_schema
    op = document["paths"][case.operation.path][case.operation.method.lower()]
    content = op["responses"]["200"]["content"]
    if NDJSON not in content:
        return None  # not a stream
    schema = {**content[NDJSON]["schema"], "components": document["components"]}
    validator = jsonschema_rs.validator_for(schema)
    for i, line in enumerate(_lines(ctype, response.content)):
        errors = [e.message for e in validator.iter_errors(line)]
        if errors:
            raise AssertionError(f"line {i} of the stream: {errors[0]}")
    return True


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    # Every phase sends through here (stateful too, where map_case hooks do not run), and the
    # case is revalidated after it: an edit never passes a negative case off as positive.
    name = case.operation.definition.raw.get("operationId")
    positive = case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE
    if name == "results" and isinstance(case.query, dict):
        case.query["timeout"] = _short(case.query.get("timeout"))
    elif name == "take" and isinstance(case.body, dict):
        case.body["timeout"] = _short(case.body.get("timeout"))
    elif name == "env_claim" and isinstance(case.body, dict) and "timeout_s" in case.body:
        case.body["timeout_s"] = _short(case.body["timeout_s"], most=defaults.API_CLAIM_WAIT_MAX_S)
    if positive and isinstance(case.body, dict):
        _small(case.body)
        if name == "submit":
            _within_what_the_document_cannot_say(case.body)
        elif CONTEXT is not None:
            _within_the_context(name, case.body, CONTEXT - CAPS["max_tokens"])


def _short(timeout: Any, most: float = 86400) -> Any:
    """A valid timeout made short; an invalid one (a negative case) kept as it is."""
    try:
        valid = timeout is None or 0 < float(timeout) <= most
    except (TypeError, ValueError):
        valid = False
    return STREAM_S if valid else timeout


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _small(value: Any) -> None:
    """Caps, in place, the samples and tokens asked anywhere in a body (a harness call's
    fields, a submit's ``sampling`` or its prompts'), and keeps token ids in ``VOCAB``."""
    if isinstance(value, list):
        for v in value:
            _small(v)
        return
    if not isinstance(value, dict):
        return
    for key, v in value.items():
        if key in TOKEN_ID_KEYS:
            value[key] = _in_vocab(v)
        elif key in CAPS and _number(v):
            value[key] = min(v, CAPS[key])
        else:
            _small(v)
    if _number(value.get("min_tokens")):
        most = value.get("max_completion_tokens") or value.get("max_tokens")
        bound = most if _number(most) else CAPS["max_tokens"]
        value["min_tokens"] = min(value["min_tokens"], bound)


def _in_vocab(value: Any) -> Any:
    if isinstance(value, list):
        return [_in_vocab(v) for v in value]
    if isinstance(value, float) and value.is_integer():  # an integral float is an id too
        return float(int(value) % VOCAB)
    return value % VOCAB if isinstance(value, int) and not isinstance(value, bool) else value


def _within_the_context(name: str, body: dict[str, Any], room: int) -> None:
    """Cuts, in place, a valid call's prompt to ``room`` tokens: with ``max_tokens`` capped
    (``CAPS``), the prompt and the tokens asked then fit the worker's context (and with
    ``max_tokens`` null, the context leaves room for one token at least)."""
    if name in ("vllm_generate", "skyrl_generate") and isinstance(body.get("token_ids"), list):
        del body["token_ids"][room:]
    elif name == "completions" and "prompt" in body:
        body["prompt"] = _cut_prompt(body["prompt"], room, body.get("add_special_tokens", True))
    elif name == "chat_completions" and TOKENIZER is not None:
        for shrink in (_drop_last_message, _drop_last_tool, _plain_messages, _plain_tools):
            while (n := _chat_prompt_len(body)) is not None and n > room and shrink(body):
                pass


def _cut_prompt(prompt: Any, room: int, special: Any) -> Any:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        return [_cut_prompt(prompt[0], room, special), *prompt[1:]]  # [one prompt]
    if isinstance(prompt, list):
        return prompt[:room]
    if isinstance(prompt, str) and TOKENIZER is not None and isinstance(special, bool):
        while len(prompt) > 1 and len(TOKENIZER.encode(prompt, add_special_tokens=special)) > room:
            prompt = prompt[: len(prompt) // 2]
    return prompt


def _chat_prompt_len(body: dict[str, Any]) -> int | None:
    """The prompt's length in tokens as the API renders it; None if it would refuse it."""
    try:
        request = ChatCompletionRequest.model_validate_json(json.dumps(body))
        return len(chat_tools.prompt_ids(TOKENIZER, request))
    except (ValueError, ApiError):  # pydantic's ValidationError is a ValueError
        return None


# Each shrinks the body one step, and says whether it could (the loop stops when none can).
def _drop_last_message(body: dict[str, Any]) -> bool:
    if len(body["messages"]) <= 1:
        return False
    body["messages"].pop()
    return True


def _drop_last_tool(body: dict[str, Any]) -> bool:
    tools = body.get("tools")
    if not isinstance(tools, list) or len(tools) <= 1:
        return False
    tools.pop()
    return True


def _plain_messages(body: dict[str, Any]) -> bool:
    if body["messages"] == PLAIN_MESSAGES:
        return False
    body["messages"] = copy.deepcopy(PLAIN_MESSAGES)
    return True


def _plain_tools(body: dict[str, Any]) -> bool:
    if not body.get("tools") or body["tools"] == PLAIN_TOOLS:
        return False
    body["tools"] = copy.deepcopy(PLAIN_TOOLS)
    return True


def _within_what_the_document_cannot_say(body: dict[str, Any]) -> None:
    prompts = body["prompts"]
    n = int(body.get("n", 1))  # 2.0 is 2
    while len(prompts) * n > defaults.MAX_SUBMIT_ROLLOUTS:
        prompts.pop()
    if isinstance(body.get("sampling"), list):
        samplings = body["sampling"]
        body["sampling"] = [samplings[i % len(samplings)] for i in range(len(prompts))]
    for holder in [body, *prompts]:
        for s in (
            holder.get("sampling")
            if isinstance(holder.get("sampling"), list)
            else [holder.get("sampling")]
        ):
            if isinstance(s, dict) and s.get("min_tokens", 0) > s["max_tokens"]:
                s["min_tokens"] = s["max_tokens"]
    for p in prompts:
        if len(msgpack.packb(p.get("metadata", {}), use_bin_type=True)) > (
            defaults.MAX_METADATA_BYTES
        ):
            p["metadata"] = {}
        episode = p.get("episode")
        if isinstance(episode, dict) and isinstance(episode.get("tools"), list):
            named = {t["name"]: t for t in episode["tools"]}  # the last of each name
            episode["tools"] = list(named.values())
    if body.get("ids") is not None:
        total = len(prompts) * n
        body["ids"] = [f"{body['ids'][i % len(body['ids'])][:180]}.{i}" for i in range(total)]
