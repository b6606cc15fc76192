"""The Workers scenario on in-process vLLM: real worker subprocesses, a real redis-server.

2 workers (each with its own AsyncLLM), 6 rollouts, at most 2 in flight per worker, every
in-flight rollout aborted twice by weight updates while generating (the same weights
republished, so greedy output must not change), run to max_tokens with ignore_eos: each
rollout ends with exactly max_tokens ids and logprobs, equal to an uninterrupted run of the
same prompt on the same workers, and its text is the decoding of its ids. Then one worker is
SIGKILLed and its engine processes must die with it.

The two tests share the two workers (module scope): each start of a vLLM worker costs two
spawned processes that import torch and vLLM (~20 s of CPU here), so a separate pair for the
kill test, and a separate in-process engine for the reference, cost ~35 s of the suite.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from statemachine import Aborted, AbortReason, RolloutRequest, SamplingParams, Status
from statemachine.status import LIVE
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.vllm_plugin import release_vllm
from tests.workers.helpers import attempt_intervals, max_overlap, stop, until
from workers.worker_cli import command

pytestmark = [
    pytest.mark.redis_server,
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
]

MAX_TOKENS = 300  # long enough for both weight updates to land mid-generation
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LOADED = b"up to"  # the worker's "worker ... on ..." line: its engine is loaded


def start_vllm_worker(url: str, model: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, ROLLOUTS_VLLM_ENGINE_ARGS='{"max_model_len": 512}')
    cmd = command(url, model, name, "--checkpoint-tokens", "8", concurrency=2, engine="vllm")
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def workers(
    server: RedisServer,
    tiny_dense_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_env: Path,
) -> AsyncIterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """Workers "v1" and "v2" on the dense tiny model: name -> (process, log file)."""
    await release_vllm()  # idle pooled engines would compete with the two workers' engines
    logs = tmp_path_factory.mktemp("vllm-workers")
    procs = {
        name: start_vllm_worker(server.url, tiny_dense_dir, name, logs / f"{name}.log")
        for name in ("v1", "v2")
    }
    try:
        yield {name: (proc, logs / f"{name}.log") for name, proc in procs.items()}
    finally:
        stop(*procs.values())


async def test_two_vllm_workers_six_rollouts_aborted_twice(
    server: RedisServer, workers: dict, tiny_dense_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_dir)
    client = RolloutClient(server.url, tokenizer=tokenizer)
    rng = np.random.default_rng(5)
    ps = [tuple(int(t) for t in rng.integers(10, 2000, 6)) for _ in range(6)]
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=GREEDY) for p in ps])

    async def generating(on: int) -> bool:
        # Live in an engine right now, its latest tokens sampled on weights `on`: so the
        # previous update is over on that worker (not just begun), and the next one has
        # something to abort.
        states = [await client.store.load(rid) for rid in ids]
        return any(
            s.status in LIVE and 0 < s.num_tokens < MAX_TOKENS and s.weight_versions[-1] == on
            for s in states
        )

    for version in (1, 2):  # republish the same weights: aborts, reload, resume
        await until(
            lambda v=version: generating(v - 1),
            timeout=300,  # the first time, both workers are still loading their engines
            what="no rollout was generating",
            every=0.01,
        )
        await client.publish_weights(version, str(tiny_dense_dir))
        await until(
            lambda v=version: _any_abort(client, ids, v),
            what=f"update {version} aborted nothing",
            every=0.01,
        )
    results = await client.wait(ids, timeout=300)
    # The reference: the same prompts again on the same workers (same weights), uninterrupted.
    ref_ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=GREEDY) for p in ps])
    references = await client.wait(ref_ids, timeout=300)
    for rid in ref_ids:
        assert not any(isinstance(e, Aborted) for e in await client.store.events(rid))

    update_aborts = await _check_against(references, client, tokenizer, ids, results)
    assert update_aborts >= 2
    events = {rid: await client.store.events(rid) for rid in ids}
    per_worker = attempt_intervals(events)
    assert set(per_worker) == {"v1", "v2"}  # both engines served
    # 2 on the engine, and at most 2 more begun while those finish (--prefetch-tokens).
    assert all(max_overlap(iv) <= 4 for iv in per_worker.values())
    await client.aclose()


async def _check_against(references, client, tokenizer, ids, results) -> int:  # type: ignore[no-untyped-def]
    """Each result equals its uninterrupted reference; returns how many weight-update aborts
    landed."""
    update_aborts = 0
    events = {rid: await client.store.events(rid) for rid in ids}
    for rid, r, ref in zip(ids, results, references, strict=True):
        assert r.status is Status.DONE and r.finish_reason == "length"
        assert ref.status is Status.DONE
        assert len(r.response_token_ids) == MAX_TOKENS
        assert len(r.logprobs) == MAX_TOKENS
        assert np.isfinite(r.logprobs).all()
        assert r.text == tokenizer.decode(r.response_token_ids.tolist(), skip_special_tokens=True)
        assert (np.diff(r.weight_versions) >= 0).all()
        assert r.response_token_ids.tolist() == ref.response_token_ids.tolist()  # no change
        np.testing.assert_allclose(r.logprobs, ref.logprobs, atol=1e-4, rtol=0)
        update_aborts += sum(
            isinstance(e, Aborted) and e.reason is AbortReason.WEIGHT_UPDATE for e in events[rid]
        )
    return update_aborts


async def _any_abort(client: RolloutClient, ids: list[str], version: int) -> bool:
    for rid in ids:
        for e in await client.store.events(rid):
            if (
                isinstance(e, Aborted)
                and e.reason is AbortReason.WEIGHT_UPDATE
                and (f"-> v{version}" in e.detail)
            ):
                return True
    return False


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc's children lists."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue  # it exited meanwhile
            todo += list(kids - out)
            out |= kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent has not reaped it yet


async def test_a_killed_vllm_workers_engine_processes_die_with_it(workers: dict) -> None:
    # Before: the EngineCore and VLLM::Worker processes of a SIGKILLed worker ran on forever
    # (~1.5 GB each here; on a GPU, the memory the restarted worker needs).
    worker, log = workers["v1"]
    deadline = time.monotonic() + 240
    while LOADED not in log.read_bytes():
        assert worker.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        await asyncio.sleep(0.2)
    engine_procs = _descendants(worker.pid)
    assert engine_procs, "the vLLM engine runs no process of its own?"
    try:
        worker.kill()
        worker.wait(10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in engine_procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        survivors = [p for p in engine_procs if _alive(p)]
        assert survivors == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in survivors]
    finally:
        for p in engine_procs:
            if _alive(p):
                os.kill(p, 9)
