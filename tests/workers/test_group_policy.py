"""Group policy on a real redis-server with an in-process worker: under ``group`` a failed
sample cancels its siblings (live ones keep their saved tokens); under ``sample`` it fails
alone."""

from __future__ import annotations

import pytest

from statemachine import FailureClass, RolloutRequest, SamplingParams, Status
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.store.trainer import finish, start
from workers.engines.synthetic import SyntheticEngine
from workers.failures import record_failure
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server

# Paced: 400 tokens at 2 ms each take ~0.8 s, so the siblings are still generating when the
# rejected sample fails at its first request.
PACED = {"tokens_per_chunk": 4, "token_delay_s": 0.002}
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def run(server: RedisServer, engine: SyntheticEngine, concurrency: int) -> None:
    config = WorkerConfig(redis_url=server.url, burst=True, max_concurrency=concurrency)
    await Worker(config, engine).run()


async def test_group_policy_cancels_the_live_siblings_of_a_failed_sample(
    server: RedisServer,
) -> None:
    client = RolloutClient(server.url)
    prompt = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=LONG)
    ids = await client.submit([prompt], n=3, group_policy="group", batch_id="grp")
    assert list(ids) == ["grp.0.0", "grp.0.1", "grp.0.2"]
    # Sample 1 is refused by the engine; 0 and 2 are generating beside it on the same worker.
    engine = SyntheticEngine(reject_rollouts=["grp.0.1"], **PACED)  # type: ignore[arg-type]
    await run(server, engine, concurrency=3)
    results = await client.wait(ids, timeout=30)
    assert [r.status for r in results] == [Status.CANCELLED, Status.FAILED, Status.CANCELLED]
    assert results[1].failure is FailureClass.REQUEST_ERROR and results[1].attempts == 1
    for r in (results[0], results[2]):
        assert "sibling grp.0.1 failed (request_error" in (r.error or "")
        # Cancelled while live: what was saved stays, short of the full 400.
        assert len(r.response_token_ids) < 400
    await client.aclose()


async def test_group_policy_when_the_request_itself_is_bad(server: RedisServer) -> None:
    # Every sample would be refused; with one slot the first to fail cancels the others
    # before they start: 1 failed, 2 cancelled, and the engine is asked once.
    client = RolloutClient(server.url)
    too_long = RolloutRequest(
        prompt_token_ids=(1,) * 8, sampling=SamplingParams(max_tokens=64, temperature=0.0)
    )
    ids = await client.submit([too_long], n=3, group_policy="group")
    await run(server, SyntheticEngine(context_length=32), concurrency=1)
    results = await client.wait(ids, timeout=30)
    assert sorted(r.status.value for r in results) == ["cancelled", "cancelled", "failed"]
    [failed] = [r for r in results if r.status is Status.FAILED]
    assert failed.failure is FailureClass.REQUEST_ERROR and "exceeds" in (failed.error or "")
    for r in results:
        if r is not failed:
            assert r.attempts == 0  # never started: cancelled while pending
            assert f"sibling {failed.rollout_id} failed" in (r.error or "")
    await client.aclose()


async def test_sample_policy_leaves_the_siblings_of_a_failed_sample_alone(
    server: RedisServer,
) -> None:
    client = RolloutClient(server.url)
    prompt = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=LONG)
    ids = await client.submit([prompt], n=3, group_policy="sample", batch_id="smp")
    engine = SyntheticEngine(reject_rollouts=["smp.0.1"], **PACED)  # type: ignore[arg-type]
    await run(server, engine, concurrency=3)
    results = await client.wait(ids, timeout=30)
    assert [r.status for r in results] == [Status.DONE, Status.FAILED, Status.DONE]
    assert results[1].failure is FailureClass.REQUEST_ERROR
    assert [len(r.response_token_ids) for r in (results[0], results[2])] == [400, 400]
    await client.aclose()


async def test_a_sibling_acknowledged_already_does_not_spare_the_others(
    server: RedisServer,
) -> None:
    """Issue 28's sibling of an ack racing a read: the trainer acknowledged one sample, then
    another failed; the cancel of the group met the acknowledged one (RolloutNotFound), gave
    up, and left the third sample running."""
    client = RolloutClient(server.url)
    try:
        prompt = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=LONG)
        ids = await client.submit([prompt], n=3, group_policy="group", batch_id="grp")
        await finish(client.store, ids[0])
        assert (await client.ack([ids[0]])).acked == [ids[0]]
        failing = await start(client.store, ids[1])
        await record_failure(client.store, failing, "refused", FailureClass.REQUEST_ERROR)
        assert await client.statuses(ids[1:]) == ["failed", "cancelled"]
    finally:
        await client.aclose()
