"""Real redis-server, real worker subprocesses: the tiny models where the model's output is
checked (`slow`), the synthetic engine where only the worker's handling of it is."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from redis import Redis
from rq import Worker as RqWorker
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from statemachine import RolloutRequest, SamplingParams, Status
from store.client import RolloutClient
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests.engine_pool import EnginePool
from tests.engines.test_cpu_moe import hf_routing
from tests.workers.helpers import (
    SYNTHETIC,
    attempt_intervals,
    direct_greedy,
    max_overlap,
    start_worker,
    stop,
)

pytestmark = pytest.mark.redis_server

GREEDY = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


def prompts(n: int) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in (np.arange(5) * (i + 3) + 11 * i + 7) % 2000) for i in range(n)]


@pytest.mark.slow
async def test_two_workers_two_slots_six_rollouts(
    cpu_pool: EnginePool, server: RedisServer, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    client = RolloutClient(server.url, tokenizer=tokenizer)
    ps = prompts(6)
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=GREEDY) for p in ps])
    workers = [
        start_worker(server.url, tiny_moe_dir, f"w{i}", tmp_path / f"w{i}.log", "--burst")
        for i in (1, 2)
    ]
    sync = Redis.from_url(server.url)
    busiest = 0
    try:
        deadline = time.monotonic() + 180
        while set(await client.statuses(ids)) != {"done"}:
            assert time.monotonic() < deadline, "rollouts did not finish"
            # rq sees our workers and how many rollouts each is running right now.
            for w in RqWorker.all(connection=sync):
                busiest = max(busiest, w.current_execution_count)
            await asyncio.sleep(0.02)
        results = await client.wait(ids, timeout=10)
        for w in workers:
            assert w.wait(60) == 0  # --burst: both exit once the queue is empty
    finally:
        stop(*workers)
    # rq counts a job until its bookkeeping is done, which overlaps the next job's start (the
    # engine slot frees when a rollout's last events are stamped), and a worker takes its next
    # job when a rollout has --prefetch-tokens left: 2 on the engine, at most 2 being begun
    # and at most 2 finishing.
    assert 2 <= busiest <= 6, f"rq showed a worker running {busiest} rollouts at once"

    # Per worker at any moment, read from the recorded events: at most 2 attempts on the
    # engine and 2 begun while those finish (tests/workers/test_prefetch.py holds the engine
    # itself to 2).
    events = {rid: await client.store.events(rid) for rid in ids}
    per_worker = attempt_intervals(events)
    assert set(per_worker) <= {"w1", "w2"}
    assert max(max_overlap(iv) for iv in per_worker.values()) >= 2
    assert all(max_overlap(iv) <= 4 for iv in per_worker.values())

    # Greedy results equal the same engine's direct generation, token for token.
    reference = await direct_greedy(cpu_pool, tiny_moe_dir, ps, GREEDY)
    for prompt, r, (ref_ids, ref_lp) in zip(ps, results, reference, strict=True):
        assert r.status is Status.DONE and r.finish_reason == "length"
        np.testing.assert_array_equal(r.response_token_ids, ref_ids)
        np.testing.assert_allclose(r.logprobs, ref_lp, atol=1e-5)
        assert (r.weight_versions == 0).all()
        assert r.prompt_token_ids == prompt
        # Text is decoded from all response ids at once with the model's tokenizer.
        assert r.text == tokenizer.decode(ref_ids.tolist(), skip_special_tokens=True)
        # One routed-experts row per generated token, equal to the HF router's top-k.
        assert r.routed_experts is not None and r.routed_experts.dtype == np.uint8
        n = len(r.response_token_ids)
        assert r.routed_experts.shape == (n, 2, 2)
        hf = hf_routing(tiny_moe_dir, [*prompt, *r.response_token_ids.tolist()])
        start = len(prompt) - 1
        np.testing.assert_array_equal(
            np.sort(r.routed_experts, -1), np.sort(hf[start : start + n], -1)
        )

    # rq's books are truthful: 6 finished jobs, no worker left registered.
    queue = rollout_queue(sync)
    assert FinishedJobRegistry(queue=queue).count == 6
    rq_cli = Path(sys.executable).with_name("rq")  # the venv's console script
    info = subprocess.run(
        [str(rq_cli), "info", "-u", server.url], capture_output=True, text=True, check=True
    ).stdout
    assert "6 finished" in info and "0 workers" in info
    await client.aclose()


async def test_poison_request_fails_alone(server: RedisServer, tmp_path: Path) -> None:
    # An engine failure (the synthetic engine's poison knob), retried within its budget. A
    # request the engine refuses outright (ids outside the vocabulary) fails at once instead:
    # tests/workers/test_failure_classes.py.
    client = RolloutClient(server.url)
    good = [RolloutRequest(prompt_token_ids=p, sampling=GREEDY) for p in prompts(3)]
    poison = RolloutRequest(prompt_token_ids=(5, 31_999, 7), sampling=GREEDY)
    ids = await client.submit([good[0], poison, good[1], good[2]])
    error = "poison token 31999"
    worker = start_worker(
        server.url,
        SYNTHETIC,
        "wp",
        tmp_path / "wp.log",
        "--burst",
        "--max-engine-attempts",
        "2",
        synthetic={"poison_token": 31_999},
    )
    try:
        results = await client.wait(ids, timeout=180)
        assert worker.wait(60) == 0
    finally:
        stop(worker)
    statuses = [r.status for r in results]
    assert statuses == ["done", "failed", "done", "done"]
    failed = results[1]
    assert error in (failed.error or "") and failed.attempts == 2
    events = await client.store.events(ids[1])
    assert [type(e).__name__ for e in events] == [
        "Submitted",
        "Started",
        "Aborted",
        "Resumed",
        "Aborted",
        "Failed",
    ]
    queue = rollout_queue(Redis.from_url(server.url))
    assert FailedJobRegistry(queue=queue).count == 1
    assert FinishedJobRegistry(queue=queue).count == 3
    await client.aclose()


async def test_job_for_a_finished_rollout_does_nothing(server: RedisServer, tmp_path: Path) -> None:
    client = RolloutClient(server.url)
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=GREEDY)])
    for round_ in range(2):
        if round_:
            enqueue_rollouts(rollout_queue(Redis.from_url(server.url)), [rid])  # a duplicate job
        w = start_worker(server.url, SYNTHETIC, f"wt{round_}", tmp_path / "wt.log", "--burst")
        try:
            assert w.wait(120) == 0
        finally:
            stop(w)
        if not round_:
            before = await client.store.events(rid)
    assert await client.store.events(rid) == before
    assert (await client.result(rid)).status is Status.DONE
    await client.aclose()
