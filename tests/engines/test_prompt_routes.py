"""Prompt routes (``EngineRequest.prompt_routes_from``): the CPU engine returns the routing of
the prefill it runs anyway, on the request's first chunk (or step) only, equal to what a plain
forward pass over the same tokens routes, under the weights that sample the first token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from statemachine.arrays import pack_array, unpack_array
from statemachine.request import SamplingParams
from tests.engine_pool import EnginePool
from tests.engines.routing import hf_routing
from tests.engines.stream import collect_request
from workers.demo.tiny_model import NUM_LAYERS, TOP_K, make_tiny_checkpoint
from workers.engines.base import EngineLimits, EngineRequest, Step
from workers.engines.cpu.channel import StepBuilder
from workers.engines.cpu.core import PREFILL_TOKENS_PER_ROUND, EngineCore
from workers.engines.cpu.engine import CpuEngine
from workers.engines.errors import RequestRejected
from workers.engines.inflight import check_request

N = 6  # tokens generated per request
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def _request(rid: str, prompt: list[int], routes_from: int | None) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=GREEDY,
        prompt_routes_from=routes_from,
    )


@pytest.fixture
def prompt(tiny_moe_dir: Path) -> list[int]:
    ids: list[int] = AutoTokenizer.from_pretrained(tiny_moe_dir)(
        "Observation: the calculator says forty two"
    ).input_ids
    assert len(ids) >= 6
    return ids


@pytest.mark.slow
async def test_the_first_chunk_carries_the_rows_of_the_asked_prompt_tokens(
    cpu_pool: EnginePool, tiny_moe_dir: Path, prompt: list[int]
) -> None:
    engine: CpuEngine = await cpu_pool.get(tiny_moe_dir)
    start = len(prompt) - 4  # as a turn asks for a 4-token observation ending its prompt
    out = await collect_request(engine, _request("routes", prompt, start))
    first, *rest = out.chunks
    assert first.prompt_routes is not None and all(c.prompt_routes is None for c in rest)
    assert first.prompt_routes.shape == (4, NUM_LAYERS, TOP_K)
    assert first.prompt_routes.dtype == np.uint8
    # Row i is the forward at input position start - 1 + i, as for generated tokens: with the
    # generated rows, one row for every position from start - 1 to the last but one.
    expected = hf_routing(tiny_moe_dir, prompt + out.token_ids)
    assert out.routed_experts is not None
    rows = np.concatenate([first.prompt_routes, out.routed_experts])
    np.testing.assert_array_equal(rows, expected[start - 1 : len(prompt) - 1 + N])
    # Asking changes nothing else: the tokens, logprobs and routes of a request that did not.
    plain = await collect_request(engine, _request("plain", prompt, None))
    assert all(c.prompt_routes is None for c in plain.chunks)
    assert plain.token_ids == out.token_ids
    np.testing.assert_array_equal(plain.logprobs, out.logprobs)
    np.testing.assert_array_equal(plain.routed_experts, out.routed_experts)  # type: ignore[arg-type]


@pytest.mark.slow
async def test_steps_carry_them_with_the_requests_first_token(
    cpu_pool: EnginePool, tiny_moe_dir: Path, prompt: list[int]
) -> None:
    engine: CpuEngine = await cpu_pool.get(tiny_moe_dir)
    asked, other = _request("asked", prompt, 1), _request("other", prompt[:-1], None)
    await engine.add(asked)
    await engine.add(other)
    got: list[tuple[int, dict[str, Any]]] = []  # (step number, its prompt routes)
    tokens: dict[str, list[int]] = {"asked": [], "other": []}
    n = 0
    async for step in engine.steps():
        n += 1
        _read(step, tokens)
        if step.prompt_routes:
            got.append((n, dict(step.prompt_routes)))
    [(_, routes)] = got  # one step carries them, for the request that asked only
    assert set(routes) == {"asked"}
    expected = hf_routing(tiny_moe_dir, prompt + tokens["asked"])
    np.testing.assert_array_equal(routes["asked"], expected[0 : len(prompt) - 1])


def test_a_read_of_several_rounds_gives_them_to_the_first_tokens_step_only() -> None:
    """Under load one read from the engine's process holds several decode rounds of a request:
    its prompt routes go with the step of its first token, not with every step it is in (the
    stepper would save them twice: a loaded CI run's episode failed with RoutesMismatch)."""
    rows = np.ones((3, NUM_LAYERS, TOP_K), dtype=np.uint8)
    dtype, shape, data = pack_array(rows)
    packed = [dtype, shape, bytes(data)]  # as the wire (msgpack) gives it back
    builder = StepBuilder()
    for token, first in ((7, True), (8, False), (9, False)):
        for rid in ("asked", "other"):
            routes = packed if first and rid == "asked" else None
            builder.take(rid, ["chunk", 1, token, -0.5, None, None, None, 0, None, routes])
    steps = builder.build()
    assert [s.token_ids.tolist() for s in steps] == [[7, 7], [8, 8], [9, 9]]
    assert [set(s.prompt_routes or {}) for s in steps] == [{"asked"}, set(), set()]
    np.testing.assert_array_equal(steps[0].prompt_routes["asked"], rows)  # type: ignore[index]


def _read(step: Step, tokens: dict[str, list[int]]) -> None:
    for rid, token in zip(step.request_ids, step.token_ids.tolist(), strict=True):
        tokens[rid].append(token)


@pytest.mark.slow
async def test_a_dense_model_has_none_to_give(
    cpu_pool: EnginePool, tiny_dense_dir: Path, prompt: list[int]
) -> None:
    engine: CpuEngine = await cpu_pool.get(tiny_dense_dir)
    out = await collect_request(engine, _request("dense", prompt, 2))
    assert all(c.prompt_routes is None and c.routed_experts is None for c in out.chunks)


@pytest.mark.slow
def test_a_weight_load_mid_prefill_routes_them_again_under_the_new_weights(
    tiny_moe_dir: Path, tmp_path: Path
) -> None:
    """The prompt's prefill is cut by a load (a prompt longer than one round's slice): the
    rows routed under the old weights are dropped with the KV cache, and the first chunk
    carries those of the recomputed prefill, under the weights that sampled its token."""
    new = make_tiny_checkpoint(tmp_path / "v1", like=tiny_moe_dir, seed=7)
    core = EngineCore(tiny_moe_dir)
    prompt = [(7 * i) % 1500 + 10 for i in range(PREFILL_TOKENS_PER_ROUND + 20)]
    start = PREFILL_TOKENS_PER_ROUND - 10  # some rows before the cut, some after
    core.handle(["add", 1, prompt, GREEDY.to_dict(), 0, start])
    core.round()  # the first slice of the prefill, under the old weights
    assert core.take_output() == []
    core.handle(["load", 0, str(new), 1])
    out: list[Any] = []
    while core.busy:
        core.round()
        out += core.take_output()
    chunks = [m for m in out if m[0] == "chunk"]
    assert [m[9] is not None for m in chunks] == [True] + [False] * (N - 1)
    assert chunks[0][7] == 1  # sampled under the new weights, and routed under them too
    expected = hf_routing(new, prompt)[start - 1 : -1]
    dtype, shape, data = chunks[0][9]  # as the core packs it, before the wire makes it bytes
    np.testing.assert_array_equal(unpack_array([dtype, shape, bytes(data)]), expected)
    # (The two checkpoints route the prompt differently, so the check above tells them apart.)
    assert not np.array_equal(hf_routing(tiny_moe_dir, prompt)[start - 1 : -1], expected)


@pytest.mark.parametrize("start", [0, -1, 5, 9])
def test_a_span_outside_the_prompt_is_refused(start: int) -> None:
    """Positions 1 .. len - 1: token 0 has no forward before it, and at least one row."""
    request = _request("bad", [1, 2, 3, 4, 5], start)
    with pytest.raises(RequestRejected, match="prompt_routes_from"):
        check_request(request, EngineLimits(context_length=None, vocab_size=None), context_name="x")
    for fine in (1, 4):
        check_request(
            _request("ok", [1, 2, 3, 4, 5], fine),
            EngineLimits(context_length=None, vocab_size=None),
            context_name="x",
        )
