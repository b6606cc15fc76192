"""An episode's turns on a worker, in-process on a real redis-server: a turn ends at the
episode's tool-call stop and records the call; the next turn resumes from the whole context
(observations included) byte for byte; budgets end the episode between turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aredis

from statemachine import FailureClass, FinishReason, RolloutState, Status
from statemachine.episode import ToolEffect, ToolSpec
from store import EventStore
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from tests import factories as f
from workers import turns
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Chunk, EngineRequest
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

VOCAB = 100
STOP = 7  # the tool-call token: the synthetic engine reaches it within VOCAB tokens
OBSERVATION = [11, 12, 13]
CALC = (ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),)


class RecordingEngine(SyntheticEngine):
    """Remembers every request it was sent (both paths: streams and steps)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.requests: list[EngineRequest] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        self.requests.append(request)
        async for chunk in super().generate(request):
            yield chunk

    async def add(self, request: EngineRequest) -> None:
        self.requests.append(request)
        await super().add(request)


@pytest.fixture
def sync(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _runner(store: EventStore, engine: SyntheticEngine, stepped: bool) -> RolloutRunner:
    return RolloutRunner(
        store, Checkpointer(store), engine, "w1", cadence=Cadence(tokens=8), stepped=stepped
    )


async def _submit(store: EventStore, rid: str = "ep", max_tokens: int = 400, **kw: Any) -> None:
    kw.setdefault("tools", CALC)
    kw.setdefault("tool_call_stop_token_ids", (STOP,))
    await store.append(None, f.episode_submitted(rid, max_tokens=max_tokens, **kw))


async def _serve_call(env: EnvironmentClient, rid: str = "ep") -> RolloutState:
    claim = await env.claim("default", "runner-1")
    assert claim is not None and claim.rollout_id == rid
    return await env.record_result(claim, OBSERVATION, seconds=0.01, env_revision="rev")


def _reference(turns: int, max_tokens: int = 400) -> tuple[list[int], list[int]]:
    """The same turns driven directly on the engine's rule, with no store: each turn's
    prompt is the whole context so far, and it ends at the first stop token. Returns the
    context after the prompt and its loss mask."""
    context: list[int] = []
    mask: list[int] = []
    for _ in range(turns):
        base = sum((1, 2, 3)) + sum(context)
        i = 0
        while True:
            token = (base + i) % VOCAB
            context.append(token)
            mask.append(1)
            i += 1
            if token == STOP or sum(mask) == max_tokens:
                break
        context += OBSERVATION
        mask += [0] * len(OBSERVATION)
    return context, mask


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_a_turn_ends_at_the_tool_call_stop_and_records_the_call(
    real_redis: aredis.Redis, stepped: bool
) -> None:
    store = EventStore(real_redis)
    await _submit(store)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    result = await _runner(store, engine, stepped).run("ep")
    assert result.outcome is Outcome.TOOL_CALL
    state = await store.load("ep")
    assert state.status is Status.AWAITING_TOOL and state == await store.replay("ep")
    [call] = state.calls
    turn = state.token_ids.tolist()
    assert turn[-1] == STOP and STOP not in turn[:-1]  # ended at its first stop token
    assert (call.name, call.offset, call.turn) == ("calc", len(turn), 0)
    assert json.loads(call.arguments) == {"token_ids": turn}
    # The engine was asked to stop at the tool-call token besides the request's own stops.
    assert STOP in engine.requests[0].sampling.stop_token_ids
    # The call waits on its environment queue.
    assert await real_redis.zrange(store.keys.env_queue("default"), 0, -1) == [b"ep"]


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_three_turns_resume_from_the_whole_context_byte_for_byte(
    real_redis: aredis.Redis, sync: redis.Redis, stepped: bool
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await _submit(store, max_turns=4)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine, stepped)
    for turn in range(3):
        assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
        state = await _serve_call(env)
        assert state.status is Status.NEXT_TURN and len(state.calls) == turn + 1
    context, mask = _reference(3)
    state = await store.load("ep")
    assert state.context_token_ids.tolist() == context
    assert state.loss_mask.tolist() == mask
    # Each turn's prompt is the prompt and the whole context so far, observations included;
    # every turn began at a boundary, so none of its prompt is the turn's own output.
    for turn, request in enumerate(engine.requests):
        assert request.prompt_token_ids == (1, 2, 3, *_reference(turn)[0])
        assert request.resumed_tokens == 0
    assert len(engine.requests) == 3
    # The fourth turn ends at the max_turns budget's call: the episode is done, no tool runs.
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.MAX_TURNS
    assert len(state.calls) == 4 and state.calls[-1].result is None
    assert state == await store.replay("ep")


async def test_a_turn_resumed_mid_way_sees_only_its_own_tokens_as_resumed(
    real_redis: aredis.Redis, sync: redis.Redis
) -> None:
    """A worker stopped mid-turn: the turn resumes with the tokens it saved, and the engine is
    told only those are its own (not the earlier turns' nor the observation)."""
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await _submit(store)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine, stepped=False)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    await _serve_call(env)
    # Turn 2, saved partly: begin it and checkpoint 5 tokens by hand, then abort it.
    state = await store.load("ep")
    state = await store.append(state, f.resumed(state))
    first = _reference(2)[0][len(_reference(1)[0]) :][:5]
    state = await store.append(state, f.tokens(state, ids=first))
    state = await store.append(state, f.aborted(state))
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    assert engine.requests[-1].resumed_tokens == 5
    context, mask = _reference(2)
    state = await store.load("ep")
    assert state.context_token_ids.tolist() == context[: len(mask) - len(OBSERVATION)]


async def test_a_budget_spent_while_waiting_ends_the_episode_before_its_next_turn(
    real_redis: aredis.Redis, sync: redis.Redis
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync, clock=lambda: 0.0)  # its clock sees no time pass
    await _submit(store, max_wall_seconds=1.0)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine, stepped=False)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    assert (await _serve_call(env)).status is Status.NEXT_TURN
    await asyncio.sleep(1.1)  # the wall time runs out while the episode waits for a worker
    result = await runner.run("ep")
    assert result.outcome is Outcome.FINISHED
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.WALL_TIME
    assert len(engine.requests) == 1  # no second turn reached the engine


async def test_an_episode_naming_a_parser_fails_as_a_request_error(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await _submit(store, parser="hermes")
    engine = RecordingEngine(vocab=VOCAB)
    result = await _runner(store, engine, stepped=False).run("ep")
    assert result.outcome is Outcome.FAILED and engine.requests == []
    state = await store.load("ep")
    assert state.failure is FailureClass.REQUEST_ERROR and "hermes" in (state.error or "")


async def test_a_job_for_an_episode_waiting_on_its_tool_writes_nothing(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await _submit(store)
    runner = _runner(store, RecordingEngine(vocab=VOCAB), stepped=False)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    before = await store.load("ep")
    assert (await runner.run("ep")).outcome is Outcome.DUPLICATE
    assert (await store.load("ep")).seq == before.seq


async def test_without_a_single_tool_the_call_is_named_by_its_stop(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await _submit(store, tools=())
    await _runner(store, RecordingEngine(vocab=VOCAB), stepped=False).run("ep")
    state = await store.load("ep")
    [call] = state.calls
    assert call.name == str(STOP)
    assert np.array_equal(json.loads(call.arguments)["token_ids"], state.token_ids)


async def test_the_context_budget_ends_a_turn_mid_way_with_its_reason(
    real_redis: aredis.Redis, sync: redis.Redis
) -> None:
    """max_total_tokens counts sampled and observation tokens: the second turn's request is
    capped to what is left, and the turn that fills it ends the episode on that budget."""
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    runner = _runner(store, RecordingEngine(vocab=VOCAB, tokens_per_chunk=4), stepped=True)
    turn_1 = len(_reference(1)[0]) - len(OBSERVATION)
    cap = turn_1 + len(OBSERVATION) + 2  # two sampled tokens of room in turn 2
    await _submit(store, max_total_tokens=cap)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    await _serve_call(env)
    assert (await runner.run("ep")).outcome is Outcome.FINISHED
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.MAX_TOTAL_TOKENS
    assert state.context_tokens == cap and state.turns[-1] == (cap - 2, cap)


async def test_tool_time_spent_ends_the_episode_at_its_next_call(
    real_redis: aredis.Redis, sync: redis.Redis
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    runner = _runner(store, RecordingEngine(vocab=VOCAB, tokens_per_chunk=4), stepped=False)
    await _submit(store, max_tool_seconds=0.5)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    claim = await env.claim("default", "runner-1")
    assert claim is not None
    await env.record_result(claim, OBSERVATION, seconds=0.75)  # the call used it all up
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL  # the turn still runs ...
    state = await store.load("ep")
    # ... and its call, which no tool time is left to run, ends the episode.
    assert state.status is Status.DONE and state.finish_reason is FinishReason.TOOL_TIME
    assert len(state.calls) == 2 and state.calls[-1].result is None
    assert await env.claim("default", "runner-1") is None


# -- a parser: the model's own tool-call syntax -------------------------------------------------
@pytest.fixture(scope="module")
def qwen_like_tokenizer() -> Any:
    """The tiny tokenizer with Qwen's tool-call markers as tokens of their own."""
    from workers.demo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return tokenizer


class ScriptedModel(RecordingEngine):
    """Says ``text`` over and over, with a tokenizer (as a CPU engine has its model's)."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        super().__init__(vocab=len(tokenizer), tokens_per_chunk=3, script=ids)
        self.tokenizer = tokenizer


CALL = 'Adding.<tool_call>{"name": "calc", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_a_hermes_turn_records_the_call_the_model_wrote(
    real_redis: aredis.Redis, qwen_like_tokenizer: Any, stepped: bool
) -> None:
    store = EventStore(real_redis)
    await _submit(store, parser="hermes", tool_call_stop_token_ids=())
    engine = ScriptedModel(qwen_like_tokenizer, CALL)
    result = await _runner(store, engine, stepped).run("ep")
    assert result.outcome is Outcome.TOOL_CALL
    state = await store.load("ep")
    [call] = state.calls
    assert (call.name, json.loads(call.arguments)) == ("calc", {"a": 1, "b": 2})
    # The turn ended at the </tool_call> token, asked for by id (one token in this tokenizer).
    end = qwen_like_tokenizer.convert_tokens_to_ids("</tool_call>")
    assert engine.requests[0].sampling.stop_token_ids == (end,)
    assert qwen_like_tokenizer.decode(state.token_ids.tolist()) == CALL


async def test_a_hermes_turn_without_a_parsable_call_ends_the_episode_as_a_stop(
    real_redis: aredis.Redis, qwen_like_tokenizer: Any
) -> None:
    store = EventStore(real_redis)
    await _submit(store, parser="hermes", tool_call_stop_token_ids=())
    text = "Adding.<tool_call>{not json}</tool_call>"
    result = await _runner(store, ScriptedModel(qwen_like_tokenizer, text), False).run("ep")
    assert result.outcome is Outcome.FINISHED
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.STOP
    assert state.calls == () and qwen_like_tokenizer.decode(state.token_ids.tolist()) == text


async def test_an_unknown_parser_is_a_request_error(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    await _submit(store, parser="mistral")
    result = await _runner(store, RecordingEngine(vocab=VOCAB), stepped=False).run("ep")
    assert result.outcome is Outcome.FAILED
    state = await store.load("ep")
    assert state.failure is FailureClass.REQUEST_ERROR and "not served" in (state.error or "")


def test_a_hermes_turn_ends_at_the_string_where_the_marker_is_no_token(
    qwen_like_tokenizer: Any,
) -> None:
    from workers.demo.tiny_model import build_tokenizer

    end = qwen_like_tokenizer.convert_tokens_to_ids("</tool_call>")
    assert turns.parser_stops(qwen_like_tokenizer) == ((end,), ())
    assert turns.parser_stops(build_tokenizer()) == ((), ("</tool_call>",))
