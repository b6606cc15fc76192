"""``Coalescer``: single calls made together are served by one batched call, and each caller
gets its own result or its own error, as if it had called alone."""

from __future__ import annotations

import asyncio

import pytest

from store.coalesce import Coalescer


class Recorder:
    """A batched call that records its batches and fails where told."""

    def __init__(self, *, bad: frozenset[int] = frozenset(), delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.bad = bad
        self.delay = delay
        self.down = False

    async def __call__(self, keys: list[int]) -> list[int | BaseException]:
        self.batches.append(keys)
        await asyncio.sleep(self.delay)
        if self.down:
            raise ConnectionError("Redis is down")
        return [ValueError(f"bad {k}") if k in self.bad else k * 10 for k in keys]


async def test_calls_made_together_are_one_batch_and_each_gets_its_result() -> None:
    many = Recorder()
    call = Coalescer(many)
    assert await asyncio.gather(*(call(k) for k in range(5))) == [0, 10, 20, 30, 40]
    assert many.batches == [[0, 1, 2, 3, 4]]


async def test_calls_made_while_a_batch_is_in_flight_go_together_in_the_next() -> None:
    many = Recorder(delay=0.05)
    call = Coalescer(many)
    first = asyncio.ensure_future(asyncio.gather(call(1), call(2)))
    await asyncio.sleep(0.01)  # the first batch is in flight now
    later = [asyncio.ensure_future(call(k)) for k in (3, 4, 5)]
    assert await first == [10, 20]
    assert await asyncio.gather(*later) == [30, 40, 50]
    assert many.batches == [[1, 2], [3, 4, 5]]  # one at a time, never one per call


async def test_a_keys_own_error_goes_to_its_caller_only() -> None:
    call = Coalescer(Recorder(bad=frozenset({2})))
    got = await asyncio.gather(call(1), call(2), call(3), return_exceptions=True)
    assert got[0] == 10 and got[2] == 30
    assert isinstance(got[1], ValueError) and str(got[1]) == "bad 2"


async def test_a_failed_batch_fails_its_callers_and_the_next_batch_runs() -> None:
    many = Recorder()
    call = Coalescer(many)
    many.down = True
    got = await asyncio.gather(call(1), call(2), return_exceptions=True)
    assert all(isinstance(g, ConnectionError) for g in got)
    many.down = False
    assert await call(3) == 30  # nothing stuck behind the failure


async def test_a_cancelled_caller_leaves_the_others_their_results() -> None:
    many = Recorder(delay=0.05)
    call = Coalescer(many)
    gone = asyncio.ensure_future(call(1))
    kept = asyncio.ensure_future(call(2))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert await kept == 20
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_batches_are_at_most_the_limit() -> None:
    many = Recorder()
    call = Coalescer(many, limit=2)
    assert await asyncio.gather(*(call(k) for k in range(5))) == [0, 10, 20, 30, 40]
    assert many.batches == [[0, 1], [2, 3], [4]]


async def test_a_batch_that_answers_for_the_wrong_number_of_calls_is_an_error() -> None:
    async def short(keys: list[int]) -> list[int]:
        return keys[:-1]

    call = Coalescer(short)
    got = await asyncio.gather(call(1), call(2), return_exceptions=True)
    assert all(isinstance(g, RuntimeError) and "1 results for 2 calls" in str(g) for g in got)
