"""CPU-engine specifics beyond the shared contract: its core process, failures, close."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from statemachine.request import SamplingParams
from tests.engine_pool import EnginePool
from tests.engines.stream import collect_request
from workers.engines.base import EngineRequest
from workers.engines.cpu.core import EngineCore
from workers.engines.cpu.engine import CpuEngine
from workers.engines.errors import EngineClosed, EngineDead, EngineError

# Real engine-core processes started and killed (seconds each): the full suite's tier.
pytestmark = pytest.mark.slow

PROMPT = (11, 12, 13, 14, 15)


def request(request_id: str, prompt: tuple[int, ...] = PROMPT, n: int = 16) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        # Long ones (n=5000) keep a stream open: generate what fits the context.
        sampling=SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True, cap_to_context=True
        ),
    )


@pytest.fixture
async def engine(cpu_pool: EnginePool, tiny_moe_dir: Path) -> CpuEngine:
    engine: CpuEngine = await cpu_pool.get(tiny_moe_dir)
    return engine


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the table: a zombie nobody reaped yet is gone too.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_model_runs_in_its_own_process(engine: CpuEngine) -> None:
    health = await engine.health()
    assert health.pid == engine.pid != os.getpid()
    assert health.weight_version == engine.weight_version


async def test_event_loop_stays_responsive(engine: CpuEngine) -> None:
    """Forwards run in the core process: the loop keeps ticking while 4 requests decode."""
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


def test_a_failing_request_fails_alone_in_the_core(
    tiny_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that raises ends that request with an error; the others carry on."""
    core = EngineCore(tiny_moe_dir)
    poison = 1999
    real_forward = core.model.forward

    def forward(token: int, cache: Any) -> Any:
        if token == poison:
            raise RuntimeError("poisoned forward")
        return real_forward(token, cache)

    monkeypatch.setattr(core.model, "forward", forward)
    greedy = request("x").sampling.to_dict()
    core.handle(["add", 1, [*PROMPT, poison], greedy, 0, None])
    core.handle(["add", 2, list(PROMPT), greedy, 0, None])
    out: list[Any] = []
    while core.busy:
        core.round()
        out += core.take_output()
    assert [m for m in out if m[1] == 1] == [
        ["error", 1, "EngineError", "RuntimeError: poisoned forward"]
    ]
    chunks = [m for m in out if m[1] == 2]
    assert [m[0] for m in chunks] == ["chunk"] * 16 and chunks[-1][5] == "length"


async def test_duplicate_in_flight_id_is_refused(engine: CpuEngine) -> None:
    stream = engine.generate(request("dup", n=500))
    await anext(stream)
    with pytest.raises(EngineError):
        await collect_request(engine, request("dup"))
    await engine.abort("dup")


async def test_consumer_leaving_frees_the_slot(engine: CpuEngine) -> None:
    async for _chunk in engine.generate(request("leaver", n=5000)):
        break  # the consumer walks away mid-stream
    # The generator's cleanup aborted the request: the core forgets it long before 5000.
    for _ in range(200):
        if (await engine.health()).requests_in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert (await engine.health()).requests_in_flight == 0
    assert engine.in_flight == []


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
    assert gone(engine.pid)
    await engine.close()  # idempotent


async def test_core_death_is_engine_dead(tiny_dense_dir: Path) -> None:
    """A killed core fails what it held and everything after with EngineDead, not a hang."""
    engine = CpuEngine(tiny_dense_dir)
    stream = engine.generate(request("open", n=5000))
    await anext(stream)
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match="died"):
        async for _chunk in stream:
            pass
    with pytest.raises(EngineDead):
        await collect_request(engine, request("late"))
    with pytest.raises(EngineDead):
        await engine.load_weights(str(tiny_dense_dir), 1)
    with pytest.raises(EngineDead):
        await engine.health()
    await engine.close()  # never raises


async def test_core_exits_when_its_worker_is_killed(tiny_dense_dir: Path) -> None:
    """kill -9 of the process that holds the engine leaves no orphan core behind."""
    script = (
        "import sys, time\n"
        "from workers.engines.cpu.engine import CpuEngine\n"
        f"e = CpuEngine({str(tiny_dense_dir)!r})\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 120)
        core_pid = int(line)
        assert not gone(core_pid)
        holder.kill()
        holder.wait()
        await wait_until(lambda: gone(core_pid))
    finally:
        holder.kill()


async def test_a_bad_model_directory_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="cannot start the CPU engine"):
        await asyncio.to_thread(CpuEngine, tmp_path / "missing")


def test_a_request_the_core_cannot_take_fails_alone(tiny_moe_dir: Path) -> None:
    core = EngineCore(tiny_moe_dir)
    core.handle(["add", 1, list(PROMPT), {"max_tokens": 4, "no_such_parameter": 1}, 0, None])
    core.handle(["add", 2, list(PROMPT), request("x", n=4).sampling.to_dict(), 0, None])
    out: list[Any] = core.take_output()
    while core.busy:
        core.round()
        out += core.take_output()
    [error] = [m for m in out if m[1] == 1]
    # A request the core cannot take is the request's fault: rejected, never retried.
    assert error[:3] == ["error", 1, "RequestRejected"] and "no_such_parameter" in error[3]
    assert [m[0] for m in out if m[1] == 2] == ["chunk"] * 4
