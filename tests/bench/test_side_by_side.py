"""``bench/side_by_side.py``'s CPU-matched side: the burner takes the share it is given, and
``compare(cpu_matched=True)`` reports what the engine alone keeps beside it; the engine alone
driven by whole steps; the wait for a round's end, woken by the worker's count; a worker that
dies fails the comparison at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from side_by_side import Burner, _pid_cpu, _until_ended, compare, requests
from watch import Died

from statemachine.status import FailureClass, Status
from store.redis_server import RedisServer
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Stats

pytestmark = pytest.mark.redis_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


def test_the_burner_keeps_its_share_of_a_core_busy() -> None:
    with Burner(0.3) as burner:
        assert burner._proc is not None
        cpu = _pid_cpu(burner._proc.pid)
        assert cpu is not None
        time.sleep(0.3)  # the interpreter's start
        c0, t0 = cpu(), time.monotonic()
        time.sleep(1.0)
        share = (cpu() - c0) / (time.monotonic() - t0)
    assert 0.1 < share < 0.5, share  # 0.3, give or take a busy machine's scheduling (0.1499 once)
    assert burner._proc.poll() is not None  # gone once the side is over


async def test_compare_reports_the_cpu_matched_side(server: RedisServer) -> None:
    engine = SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.001)
    pid = server.proc.pid if server.proc else None
    side = await compare(engine, server.url, requests(8, 16), 4, 2, cpu_matched=True, redis_pid=pid)
    figures = side.figures(8 * 16)
    assert len(side.matched_s) == len(side.durable_s) == 2
    # 0 is a figure: the added share is clamped there when a loaded machine's noise makes the
    # durable side's measured CPU less than the engine's alone (a full CI run, 8 x 16 tokens).
    assert 0.0 <= figures["cpu_added_share_of_a_core"] < 1.0
    assert figures["cpu_matched_ratio"] > 0 and figures["ratio_beyond_cpu"] > 0
    assert len(figures["ratio_beyond_cpu_each"]) == 2
    lo, hi = figures["ratio_ci95"]
    each = figures["ratio_each"]  # rounded to 3 places, the interval to 4
    assert min(each) - 1e-3 <= lo <= figures["ratio"] <= hi <= max(each) + 1e-3
    # Per round in which a freed place was refilled (a round under load once had none).
    assert figures["refill_ms"] >= 0 and 1 <= len(figures["refill_ms_each"]) <= 2


async def test_compare_can_drive_the_engine_alone_by_whole_steps(server: RedisServer) -> None:
    engine = SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.001)
    # compare asserts that the durable side's tokens equal the engine alone's, per rollout.
    side = await compare(engine, server.url, requests(8, 16), 4, 2, direct_steps_side=True)
    assert len(side.direct_s) == len(side.durable_s) == 2 and min(side.direct_s) > 0


async def test_the_wait_for_a_rounds_end_wakes_on_the_workers_count() -> None:
    stats = Stats()
    stats.end(Status.DONE)  # a round before
    waiting = asyncio.create_task(_until_ended(stats, 3))
    await asyncio.sleep(0.01)
    stats.end(Status.DONE)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    stats.end(Status.FAILED, FailureClass.WORKER_LOST)
    await asyncio.wait_for(waiting, 1.0)
    assert type(stats.ended) is dict  # the worker's own dict again, with every count
    assert stats.ended == {"done": 2, "failed": 1} and stats.failures == {"worker_lost": 1}
    await asyncio.wait_for(_until_ended(stats, 3), 1.0)  # already there: returns at once


class _BeforeModelIds:
    """An engine wrapper written before engines had a ``model_id`` (bench_weight_update's
    ``Counting`` was one): a worker on it dies at start with ``AttributeError``."""

    def __init__(self, engine: SyntheticEngine) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, request: Any) -> AsyncIterator[Any]:
        return self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def load_weights(self, source: str, version: int) -> None:
        await self.engine.load_weights(source, version)

    async def close(self) -> None:
        await self.engine.close()


async def test_a_worker_that_dies_at_start_fails_the_comparison_at_once(
    server: RedisServer,
) -> None:
    engine = _BeforeModelIds(SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.001))
    t0 = time.monotonic()
    # Before: the durable side waited forever for rollouts no worker took.
    with pytest.raises(Died, match=r"worker died: AttributeError: .*model_id") as caught:
        await compare(engine, server.url, requests(4, 8), 2, 2)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 30  # ~1 s; a busy machine's slack
    assert isinstance(caught.value.__cause__, AttributeError)
