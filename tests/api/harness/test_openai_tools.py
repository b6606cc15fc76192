"""Harness-driven episodes: chat completions with ``tools`` through the real ``openai`` client
against a real ``rollouts api --tokenizer`` process (the tiny tokenizer with its Qwen-style tool
template), a real redis-server and real worker processes on the synthetic engine told to say
one Hermes tool call (its ``script``).

The test plays the harness: each turn it sends the conversation with ``X-Session-ID``, gets the
model's call parsed into ``message.tool_calls``, appends that message and the tool's result,
and calls again. The session's trajectory is then the three turns as one sequence whose loss
mask covers exactly the sampled tokens, each call recording only the tokens its prompt added.
A worker SIGKILLed mid-turn changes nothing the client sees. Refusals: ``tool_choice``
"required" or a named function, ``tool_choice`` without tools; tools on an API whose template
renders none (``test_openai_refusals``); each request and answer as ``/openapi.json`` says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from openai import AsyncOpenAI, UnprocessableEntityError
from transformers import AutoTokenizer

from statemachine import Aborted, AbortReason, TurnRequested
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.durability import ApiProcess, session_rollouts, until_tokens
from tests.api.test_openapi import check_response
from tests.workers.helpers import SYNTHETIC, start_worker, stop
from workers.demo.tiny_tokenizer import TOOL_CHAT_TEMPLATE, make_tiny_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]  # processes start: seconds each
FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]  # fmt: skip
START = [{"role": "system", "content": "Use the tools."},
         {"role": "user", "content": "What is 1 + 2?"}]  # fmt: skip
# What the template renders between an answer's <|im_end|> and the next answer: a tool result.
OBSERVATION = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" \
    "<|im_start|>assistant\n"  # fmt: skip


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tools"), chat_template=TOOL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tok(tool_tokenizer: Path) -> Any:
    return AutoTokenizer.from_pretrained(tool_tokenizer)


@pytest.fixture(scope="module")
def script(tok: Any) -> list[int]:
    """What the engine says: the call, then <|im_end|> (the harness's stop token)."""
    return [*tok.encode(CALL, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


@pytest.fixture
async def api(
    server: RedisServer, tmp_path: Path, tool_tokenizer: Path
) -> AsyncIterator[ApiProcess]:
    a = await ApiProcess(server.url, tmp_path, ("--tokenizer", str(tool_tokenizer))).start()
    yield a
    a.stop()


def oai(api: ApiProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0, timeout=300)


async def turn(c: AsyncOpenAI, messages: list[Any], script: list[int], session: str,
               **more: Any) -> Any:  # fmt: skip
    return await c.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=200, temperature=0,
        extra_headers={"X-Session-ID": session},
        extra_body={"stop_token_ids": [script[-1]], "return_token_ids": True}, **more,
    )  # fmt: skip


def check_call(out: Any, script: list[int]) -> None:
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.token_ids == script  # type: ignore[attr-defined]
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}


async def play(c: AsyncOpenAI, script: list[int], session: str, turns: int = 3) -> list[Any]:
    """The harness: each turn, the answer's message and the tool's result appended."""
    messages: list[Any] = list(START)
    answers = []
    for _ in range(turns):
        out = await turn(c, messages, script, session)
        check_call(out, script)
        message = out.choices[0].message
        messages.append(message)  # the openai object itself, as harnesses append it
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                         "content": "3"})  # fmt: skip
        answers.append(out)
    return answers


def check_trajectory(t: Any, answers: list[Any], script: list[int], tok: Any) -> None:
    """One segment: the first prompt, then per turn the tokens its prompt added (loss 0) and
    the answer (loss 1); each prompt extends the previous prompt and answer."""
    assert t.status.value == "done" and t.breaks == [] and t.gone == ()
    [seg] = t.segments
    prompts = [list(a.prompt_token_ids) for a in answers]
    assert list(seg.prompt_token_ids) == prompts[0]
    ids, mask, turns = [], [], []
    for k, prompt in enumerate(prompts):
        context = prompts[k - 1] + script if k else prompt
        assert prompt[: len(context)] == context  # extends: only the new tokens are new
        added = prompt[len(context) :]
        assert tok.decode(added) == (OBSERVATION if k else "")
        ids += added + script
        mask += [0] * len(added) + [1] * len(script)
        turns.append((len(ids) - len(script), len(ids)))
    assert seg.token_ids.tolist() == ids
    assert seg.loss_mask.tolist() == mask
    assert seg.turns == tuple(turns)
    assert set(seg.weight_versions[seg.loss_mask == 0].tolist()) == {-1}
    assert set(seg.weight_versions[seg.loss_mask == 1].tolist()) == {0}
    assert [c.status for c in seg.calls] == ["done"] * len(answers)
    assert [f"chatcmpl-{c.batch_id}" for c in seg.calls] == [a.id for a in answers]


async def test_three_turns_with_tools_are_one_trajectory(
    api: ApiProcess, client: RolloutClient, script: list[int], tok: Any, tmp_path: Path
) -> None:
    w = start_worker(api.url, SYNTHETIC, "w", tmp_path / "w.log", synthetic={"script": script})
    c = oai(api)
    try:
        answers = await play(c, script, "episode-1")
        # tool_choice "none": the same text is not parsed.
        plain = await turn(c, START, script, "episode-2", tool_choice="none")
    finally:
        stop(w)
    check_trajectory(await client.trajectory("episode-1"), answers, script, tok)
    # One episode whose log holds the first prompt once and, per later call, only the tokens
    # its prompt added (store/harness_turns.py), not every call's whole conversation.
    [rid] = set(await session_rollouts(client, "episode-1", calls=3))
    events = await client.store.events(rid)
    assert events[0].request.prompt_token_ids == tuple(answers[0].prompt_token_ids)  # type: ignore[attr-defined]
    fed = [e.observation_token_ids.tolist() for e in events if isinstance(e, TurnRequested)]
    assert [tok.decode(ids) for ids in fed] == [OBSERVATION, OBSERVATION]
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
    # Over HTTP, as the document says.
    async with aiohttp.ClientSession() as http:
        doc = await (await http.get(f"{api.base}/openapi.json")).json()
        async with http.get(f"{api.v1}/sessions/episode-1/trajectory") as r:
            status, ctype, raw = r.status, r.content_type, await r.read()
    op = doc["paths"]["/v1/sessions/{session_id}/trajectory"]["get"]
    check_response(doc, op, status, ctype, raw, "trajectory")
    body = json.loads(raw)
    assert [len(s["calls"]) for s in body["segments"]] == [3]
    await c.close()


async def test_worker_sigkilled_mid_turn_changes_nothing_the_client_sees(
    api: ApiProcess, client: RolloutClient, script: list[int], tok: Any, tmp_path: Path
) -> None:
    paced = {"script": script, "token_delay_s": 0.03}  # ~2 s a turn: time to kill it
    a = start_worker(api.url, SYNTHETIC, "a", tmp_path / "a.log", *FAST, synthetic=paced)
    b = None
    c = oai(api)
    try:
        first = await turn(c, START, script, "episode-k")
        check_call(first, script)
        message = first.choices[0].message
        messages = [*START, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                      "content": "3"}]  # fmt: skip
        task = asyncio.create_task(turn(c, messages, script, "episode-k"))
        rid = (await session_rollouts(client, "episode-k", calls=2))[-1]
        # The calls are the turns of one episode: the second turn is under way once the
        # episode has more tokens than the first turn sampled.
        await until_tokens(client, rid, len(script) + len(script) // 2)
        a.kill()
        a.wait(10)
        b = start_worker(api.url, SYNTHETIC, "b", tmp_path / "b.log", *FAST,
                         synthetic={"script": script, "token_delay_s": 0.0})  # fmt: skip
        second = await asyncio.wait_for(task, 240)
    finally:
        stop(a, *(p for p in [b] if p))
    check_call(second, script)
    events = await client.store.events(rid)
    assert [e.reason for e in events if isinstance(e, Aborted)] == [AbortReason.WORKER_LOST]
    check_trajectory(await client.trajectory("episode-k"), [first, second], script, tok)
    await c.close()


async def test_refusals_and_the_document(api: ApiProcess, script: list[int]) -> None:
    """No worker: every call here is refused before anything is recorded."""
    c = oai(api)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(UnprocessableEntityError) as info:
            await turn(c, START, script, "refused", tool_choice=choice)
        error: Any = info.value.body
        assert error["param"] == "tool_choice" and "auto" in error["message"], error
    with pytest.raises(UnprocessableEntityError) as info:
        await c.chat.completions.create(model="tiny", messages=START, tool_choice="auto",  # type: ignore[arg-type]
                                        max_tokens=4)  # fmt: skip
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    await c.close()
    async with aiohttp.ClientSession() as http:
        doc = await (await http.get(f"{api.base}/openapi.json")).json()
        op = doc["paths"]["/v1/chat/completions"]["post"]
        schema = {**op["requestBody"]["content"]["application/json"]["schema"],
                  "components": doc["components"]}  # fmt: skip
        validator = jsonschema.Draft202012Validator(schema)
        answered = [*START, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
        assert validator.is_valid({"messages": answered, "tools": TOOLS, "tool_choice": "auto"})
        for refused in ({"messages": START, "tools": TOOLS, "tool_choice": "required"},
                        {"messages": START, "tool_choice": "auto"},
                        {"messages": START, "tools": []}):  # fmt: skip
            assert not validator.is_valid(refused), refused
            async with http.post(f"{api.v1}/chat/completions", json=refused) as r:
                check_response(doc, op, r.status, r.content_type, await r.read(), str(refused))
                assert r.status == 422
