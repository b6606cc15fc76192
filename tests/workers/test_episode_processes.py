"""Episodes on worker processes and a real redis-server: a worker SIGKILLed mid-turn loses at
most a checkpoint interval and the episode equals the same episode run uninterrupted; weight
updates between turns and within a turn leave every token tagged with the weights that
sampled it. On the synthetic engine (resume-exact, paced), and on the CPU engine with a tiny
model whose turns end at its tool-call token after a fixed number of tokens (slow)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from statemachine import (
    Aborted,
    AbortReason,
    FinishReason,
    RolloutRequest,
    SamplingParams,
    Status,
    TokensAppended,
)
from statemachine.episode import EpisodeSpec, ToolSpec
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.engine_pool import EnginePool
from tests.workers.episode_helpers import direct_episode, environment
from tests.workers.helpers import start_worker, stop, until
from workers.engines.synthetic import SyntheticEngine

pytestmark = pytest.mark.redis_server

FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")
K = 8  # the workers' checkpoint interval (start_worker's)
VOCAB = 100
STOP = 7  # the synthetic episodes' tool-call token: a turn ends within VOCAB tokens
TURNS = 3
SYNTH = {"vocab": VOCAB}


def _request(prompt: tuple[int, ...], stop: int = STOP) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=400, temperature=0.0),
        episode=EpisodeSpec(
            tool_call_stop_token_ids=(stop,),
            tools=(ToolSpec(name="calc", effect="idempotent"),),
            max_turns=TURNS,
        ),
    )


async def _long_second_turn() -> tuple[RolloutRequest, list[int], list[int]]:
    """A synthetic episode whose second turn is long enough to be killed in (>= 5 K tokens),
    with its uninterrupted context and loss mask."""
    for seed in range(50):
        request = _request(tuple((13 * seed + 3 * j) % VOCAB for j in range(5)))
        context, mask = await direct_episode(SyntheticEngine(vocab=VOCAB), request, TURNS)
        turns = _turn_lengths(mask)
        if len(turns) == TURNS and turns[1] >= 5 * K:
            return request, context, mask
    raise AssertionError("no prompt of 50 gives a long second turn")


def _turn_lengths(mask: list[int]) -> list[int]:
    lengths, run = [], 0
    for m in [*mask, 0]:
        if m:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    return lengths


async def _in_turn(client: RolloutClient, rid: str, turn: int, tokens: int) -> bool:
    """Whether the episode's ``turn`` (1-based) is generating with ``tokens`` saved."""
    s = await client.store.load(rid)
    done = s.calls[turn - 2].offset if turn > 1 and len(s.calls) >= turn - 1 else 0
    return (
        len(s.calls) == turn - 1
        and s.status in (Status.GENERATING, Status.RESUMED)
        and (s.num_tokens - done >= tokens)
    )


async def test_a_worker_killed_mid_turn_loses_nothing_saved_and_the_episode_is_exact(
    server: RedisServer, tmp_path: Path
) -> None:
    request, context, mask = await _long_second_turn()
    client = RolloutClient(server.url)
    [rid] = await client.submit([request])
    a = start_worker(server.url, None, "a", tmp_path / "a.log", *FAST, concurrency=1,
                     synthetic=SYNTH)  # fmt: skip
    b = None
    try:
        async with environment(client, server.url):
            await until(lambda: _in_turn(client, rid, 2, 2 * K), what="turn 2 never got going")
            a.kill()  # SIGKILL mid-turn: no chance to save anything
            a.wait(10)
            saved = (await client.store.load(rid)).num_tokens
            b = start_worker(server.url, None, "b", tmp_path / "b.log", *FAST, concurrency=1,
                             synthetic={**SYNTH, "token_delay_s": 0.0})  # fmt: skip
            [result] = await client.wait([rid], timeout=120)
    finally:
        stop(a, *(p for p in [b] if p))
    state = await client.store.load(rid)
    assert result.status is Status.DONE and state.finish_reason is FinishReason.MAX_TURNS
    assert state.context_token_ids.tolist() == context
    assert state.loss_mask.tolist() == mask
    assert [c.result is not None for c in state.calls] == [True, True, False]
    events = await client.store.events(rid)
    assert [e.reason for e in events if isinstance(e, Aborted)] == [AbortReason.WORKER_LOST]
    # The turn resumed where its last checkpoint ended: at most a checkpoint interval (and
    # what came while one was in flight) was lost with the worker.
    [lost] = [e for e in events if isinstance(e, Aborted)]
    resumed = [e for e in events if isinstance(e, TokensAppended) and e.attempt == lost.attempt + 1]
    assert resumed[0].offset == saved
    sizes = [len(e) for e in events if isinstance(e, TokensAppended) and e.attempt == lost.attempt]
    assert max(sizes) <= 2 * K


async def test_weight_updates_within_and_between_turns_tag_every_token(
    server: RedisServer, tmp_path: Path
) -> None:
    request, context, _ = await _long_second_turn()
    client = RolloutClient(server.url)
    [rid] = await client.submit([request])
    gate = asyncio.Event()
    a = start_worker(server.url, None, "a", tmp_path / "a.log", *FAST, concurrency=1,
                     synthetic=SYNTH)  # fmt: skip
    try:
        async with environment(client, server.url, gate=gate):
            # Between turns: v1 is published while the first call waits for its result.
            await until(lambda: _awaiting(client, rid, 1), what="no first call")
            await client.publish_weights(1, str(tmp_path))
            await asyncio.sleep(0.5)  # the worker follows the weight log within its heartbeat
            gate.set()
            # Within a turn: v2 is published while turn 2 generates (mode abort: it is
            # aborted, saved, and resumed on v2).
            await until(lambda: _in_turn(client, rid, 2, 2 * K), what="turn 2 never got going")
            await client.publish_weights(2, str(tmp_path))
            [result] = await client.wait([rid], timeout=120)
    finally:
        stop(a)
    state = await client.store.load(rid)
    assert result.status is Status.DONE and state.context_token_ids.tolist() == context
    versions = state.context_weight_versions
    mask = state.loss_mask.astype(bool)
    assert (versions[~mask] == -1).all()  # observations: sampled by no weights
    turns = state.turns
    assert set(versions[slice(*turns[0])].tolist()) == {0}
    second = versions[slice(*turns[1])].tolist()
    cut = second.index(2)
    assert cut >= 2 * K and set(second[:cut]) == {1} and set(second[cut:]) == {2}
    assert set(versions[slice(*turns[2])].tolist()) == {2}
    aborts = [e.reason for e in await client.store.events(rid) if isinstance(e, Aborted)]
    assert aborts == [AbortReason.WEIGHT_UPDATE]


async def _awaiting(client: RolloutClient, rid: str, calls: int) -> bool:
    s = await client.store.load(rid)
    return len(s.calls) == calls and s.status in (Status.AWAITING_TOOL, Status.RUNNING_TOOL)


@pytest.fixture(scope="module")
def tool_turn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tool-turn"), moe=False, tool_turn=48)


@pytest.mark.slow
async def test_cpu_engine_episode_killed_mid_turn_equals_the_uninterrupted_one(
    cpu_pool: EnginePool, server: RedisServer, tool_turn_dir: Path, tmp_path: Path
) -> None:
    from workers.demo.tiny_model import tool_call_token

    request = _request((5, 17, 300, 44, 9), stop=tool_call_token(48))
    client = RolloutClient(server.url)
    [rid] = await client.submit([request])
    a = start_worker(server.url, tool_turn_dir, "a", tmp_path / "a.log", *FAST, concurrency=1)
    b = None
    try:
        async with environment(client, server.url):
            await until(lambda: _in_turn(client, rid, 2, K), what="turn 2 never got going",
                        every=0.005)  # fmt: skip
            a.kill()
            a.wait(10)
            b = start_worker(server.url, tool_turn_dir, "b", tmp_path / "b.log", *FAST,
                             concurrency=1)  # fmt: skip
            [result] = await client.wait([rid], timeout=180)
    finally:
        stop(a, *(p for p in [b] if p))
    engine = await cpu_pool.get(tool_turn_dir)
    context, mask = await direct_episode(engine, request, TURNS)
    state = await client.store.load(rid)
    assert result.status is Status.DONE
    assert _turn_lengths(mask) == [48] * TURNS  # every turn ended at its tool-call token
    assert state.context_token_ids.tolist() == context
    assert state.loss_mask.tolist() == mask
    np.testing.assert_array_equal(state.context_weight_versions[~state.loss_mask.astype(bool)], -1)
    aborts = [e.reason for e in await client.store.events(rid) if isinstance(e, Aborted)]
    assert aborts == [AbortReason.WORKER_LOST]
