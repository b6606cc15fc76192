"""``bench/watch.py``: a benchmark waiting on something it started fails at once, with the
error, when that thing dies; what it stops on purpose, once released, does not fail it; nor
does it wait for a rollout that has ended."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from watch import Died, Watch, still_going

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.redis_server import RedisServer

FOREVER = 60.0  # what a benchmark waiting on a dead worker would wait: here, a failure
QUICK = 5.0  # how long noticing may take, on a busy machine (it takes ~0.1 s)


def python(code: str, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)


async def wait_forever() -> None:
    await asyncio.sleep(FOREVER)
    raise AssertionError("the watch did not interrupt the wait")


async def wait_watching(start: Callable[[Watch], object]) -> None:
    """A benchmark's wait on what ``start`` began and gave the watch."""
    async with Watch() as watch:
        start(watch)
        await wait_forever()


async def test_a_task_that_raises_ends_the_wait_with_its_error() -> None:
    async def worker() -> None:
        await asyncio.sleep(0.05)
        raise AttributeError("'Counting' object has no attribute 'model_id'")

    t0 = time.monotonic()
    with pytest.raises(Died, match="worker died: AttributeError: 'Counting'") as caught:
        await wait_watching(lambda w: w.task(asyncio.create_task(worker()), "worker"))
    assert time.monotonic() - t0 < QUICK
    assert isinstance(caught.value.__cause__, AttributeError)
    # The cancel that interrupted the wait was the watch's own: nothing is left pending.
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0.01)


async def test_a_lost_cancel_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import watch

    monkeypatch.setattr(watch, "RECANCEL_S", 0.2)

    async def worker() -> None:
        raise RuntimeError("gone")

    async def stubborn_wait(w: Watch) -> None:
        w.task(asyncio.create_task(worker()), "worker")
        # Lost, as redis-py loses one now and then (workers/worker.py).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(FOREVER)
        await wait_forever()

    async def benchmark() -> None:
        async with Watch() as w:
            await stubborn_wait(w)

    with pytest.raises(Died, match="worker died: RuntimeError: gone"):
        await benchmark()
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_a_task_that_returns_while_needed_ends_the_wait() -> None:
    async def worker() -> str:
        return "stopped: engine died"

    with pytest.raises(Died, match="worker ended while the benchmark still needed it: 'stopped"):
        await wait_watching(lambda w: w.task(asyncio.create_task(worker()), "worker"))


async def test_what_is_released_may_end() -> None:
    stop = asyncio.Event()

    async def worker() -> None:
        await stop.wait()

    async with Watch() as watch:
        run = watch.task(asyncio.create_task(worker()), "worker")
        await asyncio.sleep(0.2)
        watch.release(run)
        stop.set()
        await run
        await asyncio.sleep(0.3)  # the poller's turn comes and goes
    assert watch.died is None


async def test_a_process_that_exits_ends_the_wait_with_its_log(tmp_path: Path) -> None:
    proc = python("import sys; print('cannot start the engine: no model'); sys.exit(3)",
                  tmp_path / "w.log")  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(Died, match=r"(?s)worker a \(pid \d+\) exited with status 3.*no model"):
        await wait_watching(lambda w: w.process(proc, "worker a", tmp_path / "w.log"))
    assert time.monotonic() - t0 < QUICK


async def test_a_killed_process_is_named_by_its_signal(tmp_path: Path) -> None:
    proc = python("import time; time.sleep(60)", tmp_path / "w.log")

    def start(watch: Watch) -> None:
        watch.process(proc, "api")
        proc.kill()

    with pytest.raises(Died, match=r"api \(pid \d+\) was killed by SIGKILL"):
        await wait_watching(start)


async def test_a_process_released_before_it_is_stopped_does_not_fail(tmp_path: Path) -> None:
    proc = python("import time; time.sleep(60)", tmp_path / "w.log")
    async with Watch() as watch:
        watch.process(proc, "victim")
        watch.release(proc)
        proc.kill()
        proc.wait()
        await asyncio.sleep(0.3)
    assert watch.died is None


def test_check_raises_in_a_synchronous_loop(tmp_path: Path) -> None:
    watch = Watch()
    watch.process(python("pass", tmp_path / "w.log"), "rq worker", tmp_path / "w.log")
    deadline = time.monotonic() + QUICK
    with pytest.raises(Died, match=r"rq worker \(pid \d+\) exited with status 0"):  # noqa: PT012
        while time.monotonic() < deadline:
            watch.check()
            time.sleep(0.01)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.mark.redis_server
async def test_a_redis_server_that_dies_ends_the_wait(server: RedisServer) -> None:
    def start(watch: Watch) -> None:
        watch.redis(server)
        assert server.proc is not None
        server.proc.kill()

    with pytest.raises(Died, match=r"redis-server \(pid \d+\) was killed by SIGKILL"):
        await wait_watching(start)


@pytest.mark.redis_server
async def test_a_rollout_that_ended_is_not_waited_for(server: RedisServer) -> None:
    client = RolloutClient(server.url)
    sampling = SamplingParams(max_tokens=8)
    live, ended = await client.submit([RolloutRequest(prompt_token_ids=(1, 2), sampling=sampling)
                                       for _ in range(2)])  # fmt: skip
    await client.cancel([ended])
    try:
        await still_going(client, live, "8 tokens")  # pending: it may still get there
        with pytest.raises(Died, match=f"rollout {ended} ended cancelled while the benchmark "
                                       "waited for 8 tokens"):  # fmt: skip
            await still_going(client, ended, "8 tokens")
    finally:
        await client.aclose()
