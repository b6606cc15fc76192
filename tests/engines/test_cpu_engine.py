"""CPU-engine specifics beyond the shared contract: threading, failures, close."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from statemachine.request import SamplingParams
from workers.engines.base import EngineRequest
from workers.engines.cpu import CpuEngine
from workers.engines.stream import collect_request
from workers.errors import EngineClosed, EngineError

PROMPT = (11, 12, 13, 14, 15)


def request(request_id: str, prompt: tuple[int, ...] = PROMPT, n: int = 16) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )


@pytest.fixture
async def engine(tiny_moe_dir: Path):
    engine = CpuEngine(tiny_moe_dir)
    yield engine
    await engine.close()


async def test_event_loop_stays_responsive(engine: CpuEngine) -> None:
    """Forwards run on the engine thread: the loop keeps ticking while 4 requests decode."""
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.002)

    task = asyncio.create_task(ticker())
    await asyncio.gather(*(collect_request(engine, request(f"r{i}", n=60)) for i in range(4)))
    done.set()
    await task
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 20
    assert max(gaps) < 0.25  # a blocked loop would stall for the whole generation


async def test_a_failing_request_fails_alone(
    engine: CpuEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = 1999
    real_forward = engine._model.forward

    def forward(token: int, cache: Any) -> Any:
        if token == poison:
            raise RuntimeError("poisoned forward")
        return real_forward(token, cache)

    monkeypatch.setattr(engine._model, "forward", forward)
    results = await asyncio.gather(
        collect_request(engine, request("bad", prompt=(*PROMPT, poison))),
        collect_request(engine, request("good")),
        return_exceptions=True,
    )
    assert isinstance(results[0], EngineError)
    assert "poisoned forward" in str(results[0])
    assert not isinstance(results[1], BaseException)
    assert len(results[1].token_ids) == 16


async def test_duplicate_in_flight_id_is_refused(engine: CpuEngine) -> None:
    stream = engine.generate(request("dup", n=500))
    await anext(stream)
    with pytest.raises(EngineError):
        await collect_request(engine, request("dup"))
    await engine.abort("dup")


async def test_consumer_leaving_frees_the_slot(engine: CpuEngine) -> None:
    async for _chunk in engine.generate(request("leaver", n=5000)):
        break  # the consumer walks away mid-stream
    # The generator's cleanup aborted the request: the engine goes idle long before 5000.
    for _ in range(200):
        if not engine._active and not engine._new:
            break
        await asyncio.sleep(0.01)
    assert not engine._active


async def test_close_ends_streams_and_refuses_work(tiny_dense_dir: Path) -> None:
    engine = CpuEngine(tiny_dense_dir)
    stream = engine.generate(request("open", n=5000))
    await anext(stream)
    await engine.close()
    with pytest.raises(EngineClosed):
        async for _chunk in stream:
            pass
    with pytest.raises(EngineClosed):
        await collect_request(engine, request("late"))
    with pytest.raises(EngineClosed):
        await engine.load_weights(str(tiny_dense_dir), 1)
