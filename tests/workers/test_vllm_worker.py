"""The Workers scenario on in-process vLLM: real worker subprocesses, a real redis-server.

2 workers (each with its own AsyncLLM), 6 rollouts, at most 2 in flight per worker, every
in-flight rollout aborted twice by weight updates while generating (the same weights
republished, so greedy output must not change), run to max_tokens with ignore_eos: each
rollout ends with exactly max_tokens ids and logprobs, equal to vLLM's direct greedy output,
and its text is the decoding of its ids.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from statemachine import Aborted, AbortReason, RolloutRequest, SamplingParams, Status
from statemachine.status import LIVE
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.engines.stream import collect_request
from tests.vllm_plugin import release_vllm
from tests.workers.helpers import attempt_intervals, max_overlap, stop, until
from workers.engines.base import EngineRequest
from workers.worker_cli import command

pytestmark = [
    pytest.mark.redis_server,
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
]

MAX_TOKENS = 300  # long enough for both weight updates to land mid-generation
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def start_vllm_worker(url: str, model: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, ROLLOUTS_VLLM_ENGINE_ARGS='{"max_model_len": 512}')
    cmd = command(url, model, name, "--checkpoint-tokens", "8", concurrency=2, engine="vllm")
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


async def test_two_vllm_workers_six_rollouts_aborted_twice(
    server: RedisServer, tiny_dense_dir: Path, tmp_path: Path, vllm_env: Path, vllm_pool
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_dir)
    client = RolloutClient(server.url, tokenizer=tokenizer)
    rng = np.random.default_rng(5)
    ps = [tuple(int(t) for t in rng.integers(10, 2000, 6)) for _ in range(6)]
    await release_vllm()  # idle pooled engines would compete with the two workers' engines
    workers = [
        start_vllm_worker(server.url, tiny_dense_dir, f"v{i}", tmp_path / f"v{i}.log")
        for i in (1, 2)
    ]
    try:
        ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=GREEDY) for p in ps])

        async def generating(on: int) -> bool:
            # Live in an engine right now, its latest tokens sampled on weights `on`: so the
            # previous update is over on that worker (not just begun), and the next one has
            # something to abort.
            states = [await client.store.load(rid) for rid in ids]
            return any(
                s.status in LIVE
                and 0 < s.num_tokens < MAX_TOKENS
                and s.weight_versions[-1] == on
                for s in states
            )

        for version in (1, 2):  # republish the same weights: aborts, reload, resume
            await until(
                lambda v=version: generating(v - 1), what="no rollout was generating", every=0.01
            )
            await client.publish_weights(version, str(tiny_dense_dir))
            await until(
                lambda v=version: _any_abort(client, ids, v),
                what=f"update {version} aborted nothing",
                every=0.01,
            )
        results = await client.wait(ids, timeout=300)
    finally:
        stop(*workers)

    engine = await vllm_pool.get(tiny_dense_dir)
    try:
        update_aborts = await _check_against_direct(engine, client, tokenizer, ids, ps, results)
    finally:
        await release_vllm()  # the reference engine's idle polling would slow later tests
    assert update_aborts >= 2
    events = {rid: await client.store.events(rid) for rid in ids}
    per_worker = attempt_intervals(events)
    assert set(per_worker) == {"v1", "v2"}  # both engines served
    assert all(max_overlap(iv) <= 2 for iv in per_worker.values())
    await client.aclose()


async def _check_against_direct(engine, client, tokenizer, ids, ps, results) -> int:  # type: ignore[no-untyped-def]
    """Each result equals direct generation; returns how many weight-update aborts landed."""
    update_aborts = 0
    events = {rid: await client.store.events(rid) for rid in ids}
    for i, (rid, prompt, r) in enumerate(zip(ids, ps, results, strict=True)):
        assert r.status is Status.DONE and r.finish_reason == "length"
        assert len(r.response_token_ids) == MAX_TOKENS
        assert len(r.logprobs) == MAX_TOKENS
        assert np.isfinite(r.logprobs).all()
        assert r.text == tokenizer.decode(r.response_token_ids.tolist(), skip_special_tokens=True)
        assert (np.diff(r.weight_versions) >= 0).all()
        direct = await collect_request(
            engine, EngineRequest(request_id=f"direct{i}", prompt_token_ids=prompt, sampling=GREEDY)
        )
        assert r.response_token_ids.tolist() == direct.token_ids  # aborts changed nothing
        np.testing.assert_allclose(r.logprobs, direct.logprobs, atol=1e-4, rtol=0)
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


async def test_a_killed_vllm_workers_engine_processes_die_with_it(
    server: RedisServer, tiny_dense_dir: Path, tmp_path: Path, vllm_env: Path
) -> None:
    # Before: the EngineCore and VLLM::Worker processes of a SIGKILLed worker ran on forever
    # (~1.5 GB each here; on a GPU, the memory the restarted worker needs).
    await release_vllm()
    log = tmp_path / "v.log"
    worker = start_vllm_worker(server.url, tiny_dense_dir, "doomed", log)
    try:
        deadline = time.monotonic() + 240
        while b"up to" not in log.read_bytes():  # its "worker ... on ..." line: engine loaded
            assert worker.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        engine_procs = _descendants(worker.pid)
        assert engine_procs, "the vLLM engine runs no process of its own?"
        worker.kill()
        worker.wait(10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in engine_procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        survivors = [p for p in engine_procs if _alive(p)]
        assert survivors == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in survivors]
    finally:
        for p in _descendants(worker.pid) if worker.poll() is None else ():
            os.kill(p, 9)
        stop(worker)
