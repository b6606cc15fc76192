"""Lean outputs on in-process vLLM (``workers/engines/vllm/lean.py``): stepped requests get
them, and they carry exactly what vLLM's own outputs carry, chunk by chunk, at one token per
output and at vLLM's stream-interval batching; a request they cannot serve (stop strings)
keeps vLLM's outputs. Routed experts cannot be checked here: vLLM returns them on GPU only."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from statemachine.request import SamplingParams
from tests.engines.stream import collect_request
from workers.engines.base import EngineRequest
from workers.engines.vllm import lean

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PROMPTS = ((11, 402, 97, 1203, 7), (5, 6, 7, 8, 9, 10, 11), (1500, 3, 77))
LENGTHS = (9, 17, 4)


def greedy(rid: str, prompt: tuple[int, ...], n: int, stop: tuple[str, ...] = ()) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=stop),
    )


async def stepped(engine: Any, reqs: list[EngineRequest]) -> tuple[dict, dict, list[type]]:
    """Per request: token ids, logprobs and the sizes of its pieces, read off whole steps;
    and the type of every output vLLM handed the engine."""
    kinds: list[type] = []
    take = engine._take_output

    def spy(stream: Any, sub_id: Any, output: Any) -> None:
        kinds.append(type(output))
        take(stream, sub_id, output)

    engine._take_output = spy
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    logprobs: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    sizes: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    try:
        for r in reqs:
            await engine.add(r)
        async for step in engine.steps():
            counts = [1] * len(step.request_ids) if step.counts is None else step.counts.tolist()
            lo = 0
            for rid, n in zip(step.request_ids, counts, strict=True):
                ids[rid] += step.token_ids[lo : lo + n].tolist()
                logprobs[rid] += step.logprobs[lo : lo + n].tolist()
                sizes[rid].append(n)
                lo += n
            assert all(end.error is None for end in step.ends.values())
    finally:
        del engine._take_output  # the class's method again
    return {"ids": ids, "logprobs": logprobs}, sizes, kinds


@pytest.mark.parametrize("interval", [1, 4])
async def test_lean_outputs_carry_what_vllms_own_carry(
    vllm_pool, tiny_moe_dir: Path, monkeypatch: pytest.MonkeyPatch, interval: int
) -> None:
    engine = await vllm_pool.get(tiny_moe_dir)
    options = engine.options
    # The per-request stream interval the engine submits with (vLLM batches by the larger of
    # it and its own, 1 here): vLLM's real batching, on the pooled engine.
    engine.options = dataclasses.replace(options, stream_interval=interval)
    try:
        reqs = [
            greedy(f"lean{interval}-{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))
        ]
        lean_got, lean_sizes, lean_kinds = await stepped(engine, reqs)
        with monkeypatch.context() as m:
            m.setattr(lean, "install_for", lambda processor, request_id: False)
            reqs = [
                greedy(f"own{interval}-{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))
            ]
            own_got, own_sizes, own_kinds = await stepped(engine, reqs)
    finally:
        engine.options = options
    assert set(lean_kinds) == {lean.LeanOutput}  # in use: a vLLM upgrade may not silently drop it
    assert lean.LeanOutput not in own_kinds
    for i, n in enumerate(LENGTHS):
        a, b = f"lean{interval}-{i}", f"own{interval}-{i}"
        assert lean_got["ids"][a] == own_got["ids"][b] and len(lean_got["ids"][a]) == n
        np.testing.assert_allclose(
            lean_got["logprobs"][a], own_got["logprobs"][b], atol=1e-6, rtol=0
        )
        # vLLM's batching kept: every token comes, in pieces of several at an interval above 1.
        # Not compared piece by piece with the other run: under load vLLM's output collector
        # merges outputs its consumer has not read yet (CI saw [1, 1, 2, ...] vs [1, 1, 1, ...]).
        assert sum(lean_sizes[a]) == sum(own_sizes[b]) == n
        if interval > 1:
            assert max(lean_sizes[a]) > 1
        alone = await collect_request(engine, greedy(f"gen{interval}-{i}", PROMPTS[i], n))
        assert alone.token_ids == lean_got["ids"][a]
        np.testing.assert_allclose(alone.logprobs, lean_got["logprobs"][a], atol=1e-4, rtol=0)


async def test_a_request_with_stop_strings_keeps_vllms_outputs(
    vllm_pool, tiny_moe_dir: Path
) -> None:
    """Stop strings need vLLM's detokenizer, which may trim tokens it already counted: such
    a request is not given lean outputs, and gets what ``generate`` gets."""
    engine = await vllm_pool.get(tiny_moe_dir)
    req = greedy("stop-0", PROMPTS[0], 12, stop=("zzzz-never",))
    got, _, kinds = await stepped(engine, [req])
    assert kinds and lean.LeanOutput not in kinds
    alone = await collect_request(engine, greedy("stop-gen", PROMPTS[0], 12, stop=("zzzz-never",)))
    assert got["ids"]["stop-0"] == alone.token_ids and len(alone.token_ids) == 12
    np.testing.assert_allclose(got["logprobs"]["stop-0"], alone.logprobs, atol=1e-4, rtol=0)


async def test_another_vllms_layout_keeps_vllms_outputs(caplog: pytest.LogCaptureFixture) -> None:
    """A RequestState laid out otherwise than vLLM 0.32's (here: no ``detokenizer``) is
    left as it was, its request served by vLLM's own outputs, with one warning."""
    from vllm.sampling_params import RequestOutputKind

    own = object()
    state = types.SimpleNamespace(
        parent_req=None, output_kind=RequestOutputKind.DELTA, make_request_output=own
    )
    processor = types.SimpleNamespace(
        external_req_ids={"r": ["r-1a2b"]}, request_states={"r-1a2b": state}
    )
    lean._warned.clear()
    with caplog.at_level("WARNING", logger=lean.__name__):
        assert lean.install_for(processor, "r") is False
        assert lean.install_for(processor, "r") is False
    assert state.make_request_output is own and not hasattr(state, "logprobs_processor")
    warned = [r.getMessage() for r in caplog.records if r.name == lean.__name__]
    assert len(warned) == 1 and "detokenizer" in warned[0]
    assert lean.install_for(processor, "unknown") is False
