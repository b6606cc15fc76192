"""The ``StepEngine`` contract: whole steps give each request exactly what ``generate`` gives it
(tokens, logprobs, routes, versions, finish), resume exactly, abort cleanly and refuse what
``generate`` refuses. Run on the synthetic engine and on the CPU engine's core process."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from statemachine import FinishReason, SamplingParams
from tests.engine_pool import EnginePool
from tests.engines.stream import collect_request
from workers.engines.base import End, EngineRequest, Step, StepEngine
from workers.engines.errors import RequestAborted, RequestRejected
from workers.engines.synthetic import SyntheticEngine

# The CPU cases share the session's pooled engines, bound to the session loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")


@dataclass
class Stepped:
    """What the steps gave one request, concatenated."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    end: End | None = None
    tops: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # [n, K] each


def read(step: Step, out: dict[str, Stepped]) -> None:
    counts = [1] * len(step.request_ids) if step.counts is None else step.counts.tolist()
    assert sum(counts) == len(step.token_ids) == len(step.logprobs)
    assert len(set(step.request_ids)) == len(step.request_ids)  # once per step at most
    lo = 0
    for rid, n in zip(step.request_ids, counts, strict=True):
        got = out[rid]
        assert got.end is None, f"{rid}: tokens after its end"
        got.token_ids += step.token_ids[lo : lo + n].tolist()
        got.logprobs += step.logprobs[lo : lo + n].tolist()
        got.versions += [step.weight_version] * n
        if step.routed_experts is not None:
            got.routes.append(step.routed_experts[lo : lo + n])
        if step.top_token_ids is not None and step.top_logprobs is not None:
            assert step.top_token_ids.shape == step.top_logprobs.shape
            assert step.top_token_ids.shape[0] == len(step.token_ids)
            got.tops.append((step.top_token_ids[lo : lo + n], step.top_logprobs[lo : lo + n]))
        lo += n
    for rid, end in step.ends.items():
        out[rid].end = end


async def run_steps(
    engine: StepEngine,
    requests: list[EngineRequest],
    during: Callable[[int, dict[str, Stepped]], Awaitable[None]] | None = None,
) -> dict[str, Stepped]:
    """Add ``requests`` and read every step; ``during(n, so_far)`` runs after the n-th."""
    out = {r.request_id: Stepped() for r in requests}
    for r in requests:
        await engine.add(r)
    n = 0
    async for step in engine.steps():
        read(step, out)
        n += 1
        if during is not None:
            await during(n, out)
    return out


def request(
    rid: str, prompt: tuple[int, ...], n: int, resumed: int = 0, logprobs: int = 0
) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs),
        resumed_tokens=resumed,
    )


PROMPTS = ((11, 12, 13, 14, 15), (3, 1, 4, 1, 5, 9, 2, 6), (100, 200, 300))


@pytest.fixture(
    params=[
        "synthetic-1",
        "synthetic-5",
        "cpu-dense",
        pytest.param("cpu-moe", marks=pytest.mark.slow),
        pytest.param("vllm-moe", marks=(pytest.mark.vllm, pytest.mark.slow)),
    ]
)
def step_case(request: pytest.FixtureRequest) -> tuple[str, EnginePool | None]:
    """The case and its engine pool, resolved here, outside any running loop."""
    kind: str = request.param
    if kind.startswith("synthetic"):
        return kind, None
    pool: EnginePool = request.getfixturevalue("vllm_pool" if "vllm" in kind else "cpu_pool")
    return kind, pool


@pytest_asyncio.fixture(loop_scope="session")
async def step_engine(
    step_case: tuple[str, EnginePool | None], tiny_dense_dir: Path, tiny_moe_dir: Path
) -> Any:
    kind, pool = step_case
    if pool is None:
        return SyntheticEngine(tokens_per_chunk=int(kind[-1]), experts=8, vocab=2048)
    return await pool.get(tiny_dense_dir if kind == "cpu-dense" else tiny_moe_dir)


async def test_steps_give_each_request_what_generate_gives(step_engine: Any) -> None:
    lengths = (9, 17, 4)
    reqs = [request(f"s{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    stepped = await run_steps(step_engine, reqs)
    for i, r in enumerate(reqs):
        alone = await collect_request(step_engine, request(f"g{i}", PROMPTS[i], lengths[i]))
        got = stepped[r.request_id]
        assert got.token_ids == alone.token_ids and len(got.token_ids) == lengths[i]
        np.testing.assert_allclose(got.logprobs, alone.logprobs, rtol=0, atol=1e-4)
        assert got.versions == alone.weight_versions
        if alone.routed_experts is None:
            assert not got.routes
        else:
            np.testing.assert_array_equal(np.concatenate(got.routes), alone.routed_experts)
        assert got.end is not None and got.end.error is None
        assert got.end.finish_reason is FinishReason.LENGTH is alone.finish_reason


async def test_steps_carry_each_requests_top_logprobs_as_generate_does(step_engine: Any) -> None:
    """Requests asking different k (0 among them) in the same steps: each one's first k
    columns are exactly the top-k its ``generate`` stream gives."""
    ks, lengths = (0, 2, 5), (9, 17, 4)
    reqs = [
        request(f"t{i}", p, n, logprobs=k)
        for i, (p, n, k) in enumerate(zip(PROMPTS, lengths, ks, strict=True))
    ]
    stepped = await run_steps(step_engine, reqs)
    for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
        alone = await collect_request(
            step_engine, request(f"u{i}", PROMPTS[i], lengths[i], logprobs=k)
        )
        got = stepped[r.request_id]
        assert got.token_ids == alone.token_ids
        if k == 0:
            assert all(c.top_token_ids is None for c in alone.chunks)
            continue
        want_ids = np.concatenate([c.top_token_ids for c in alone.chunks])  # type: ignore[misc]
        want_lps = np.concatenate([c.top_logprobs for c in alone.chunks])  # type: ignore[misc]
        assert want_ids.shape == (lengths[i], k)
        # A step is as wide as the widest k of the requests in it: each takes its first k.
        got_ids = np.concatenate([ids[:, :k] for ids, _ in got.tops])
        got_lps = np.concatenate([lps[:, :k] for _, lps in got.tops])
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_lps, want_lps, rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [1, 7, 16])
async def test_a_resume_through_steps_equals_the_uninterrupted_run(
    step_engine: Any, k: int
) -> None:
    n = 24
    [full] = (await run_steps(step_engine, [request("full", PROMPTS[1], n)])).values()
    [head] = (await run_steps(step_engine, [request("head", PROMPTS[1], k)])).values()
    resumed = request("tail", (*PROMPTS[1], *head.token_ids), n - k, resumed=k)
    [tail] = (await run_steps(step_engine, [resumed])).values()
    assert head.token_ids + tail.token_ids == full.token_ids
    np.testing.assert_allclose(head.logprobs + tail.logprobs, full.logprobs, rtol=0, atol=1e-4)
    if full.routes:
        both = np.concatenate(head.routes + tail.routes)
        assert both.shape[0] == n  # one row per token: none duplicated at the resume point
        np.testing.assert_array_equal(both, np.concatenate(full.routes))


async def test_an_aborted_request_yields_nothing_more_and_the_others_go_on(
    step_engine: Any,
) -> None:
    reqs = [request("keep", PROMPTS[0], 12), request("stop", PROMPTS[1], 400)]
    seen_after: list[int] = []

    async def during(n: int, so_far: dict[str, Stepped]) -> None:
        if n == 3:
            await step_engine.abort("stop")
            await step_engine.abort("stop")  # idempotent
            seen_after.append(len(so_far["stop"].token_ids))

    out = await run_steps(step_engine, reqs, during)
    assert len(out["keep"].token_ids) == 12 and out["keep"].end is not None
    assert out["keep"].end.finish_reason is FinishReason.LENGTH
    assert len(out["stop"].token_ids) == seen_after[0] < 400  # nothing after abort returned
    if out["stop"].end is not None:  # reporting the abort is allowed, not required
        assert isinstance(out["stop"].end.error, RequestAborted)


async def test_nothing_of_an_aborted_request_comes_even_from_steps_made_before_the_abort(
    step_engine: Any,
) -> None:
    # A consumer that lags (a worker under load) lets the engine run steps ahead of it; the
    # abort must still hold for what was produced before it and not read yet. The CPU engine
    # once yielded the steps its reader had queued, aborted request's tokens included (CI saw
    # 5 tokens where 3 had been read at the abort).
    stop = f"stop-{uuid.uuid4().hex}"
    reqs = [request("keep-lag", PROMPTS[0], 24), request(stop, PROMPTS[1], 400)]
    at_abort: list[int] = []

    async def lag_then_abort(n: int, so_far: dict[str, Stepped]) -> None:
        if n == 2:
            await asyncio.sleep(0.5)  # the engine runs ahead of this consumer
            await step_engine.abort(stop)
            at_abort.append(len(so_far[stop].token_ids))

    out = await run_steps(step_engine, reqs, lag_then_abort)
    assert len(out["keep-lag"].token_ids) == 24
    assert len(out[stop].token_ids) == at_abort[0]  # nothing after the abort, queued or not
    if out[stop].end is not None:
        assert isinstance(out[stop].end.error, RequestAborted)


async def test_add_refuses_what_generate_refuses(step_engine: Any) -> None:
    vocab = step_engine.limits.vocab_size
    with pytest.raises(RequestRejected):
        await step_engine.add(request("bad", (vocab + 5,), 4))
    # An id of its own: the engines are pooled across tests, and one that ended under the
    # same id (the contract suite's "early") makes a later abort of it a no-op, rightly.
    early = f"early-{uuid.uuid4().hex}"
    await step_engine.abort(early)  # before it came: remembered
    with pytest.raises(RequestAborted):
        await step_engine.add(request(early, PROMPTS[0], 4))
    # Nothing in flight: steps end at once.
    assert [s async for s in step_engine.steps() if s.request_ids] == []
