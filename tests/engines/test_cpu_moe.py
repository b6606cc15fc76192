"""Routed experts from the CPU engine on the tiny Qwen3-MoE model, checked against HF's router."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from statemachine.request import SamplingParams
from tests.engine_pool import EnginePool
from tests.engines.routing import hf_routing
from tests.engines.stream import Generation, collect_request
from workers.demo.tiny_model import NUM_EXPERTS, NUM_LAYERS, TOP_K
from workers.engines.base import EngineRequest, expert_dtype
from workers.engines.cpu.engine import CpuEngine

# The MoE model against the HF router: a real model, the full suite's tier.
pytestmark = pytest.mark.slow


@pytest.fixture
async def moe_engine(cpu_pool: EnginePool, tiny_moe_dir: Path) -> CpuEngine:
    engine: CpuEngine = await cpu_pool.get(tiny_moe_dir)
    return engine


async def generate(engine: CpuEngine, prompt: list[int], **sampling: object) -> Generation:
    request = EngineRequest(
        request_id="moe", prompt_token_ids=tuple(prompt), sampling=SamplingParams(**sampling)
    )
    return await collect_request(engine, request)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_one_row_per_token_equal_to_hf_router(
    moe_engine: CpuEngine, tiny_moe_dir: Path, temperature: float
) -> None:
    prompt = AutoTokenizer.from_pretrained(tiny_moe_dir)("Router layer expert batch").input_ids
    n = 20
    out = await generate(
        moe_engine, prompt, max_tokens=n, temperature=temperature, seed=3, ignore_eos=True
    )
    routed = out.routed_experts
    assert routed is not None
    assert routed.shape == (n, NUM_LAYERS, TOP_K)
    assert routed.dtype == np.uint8
    for chunk in out.chunks:
        assert chunk.routed_experts is not None
        assert chunk.routed_experts.shape == (len(chunk.token_ids), NUM_LAYERS, TOP_K)
    # Row t is the routing of the forward that produced token t: input position
    # len(prompt) - 1 + t of prompt + generated.
    expected = hf_routing(tiny_moe_dir, prompt + out.token_ids)
    start = len(prompt) - 1
    np.testing.assert_array_equal(routed, expected[start : start + n])
    assert len(np.unique(routed)) > TOP_K  # the random router really spreads tokens


async def test_rows_when_stopped_early(moe_engine: CpuEngine, tiny_moe_dir: Path) -> None:
    prompt = AutoTokenizer.from_pretrained(tiny_moe_dir)("Quick slow bright dark").input_ids
    full = await generate(moe_engine, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    stop_id = full.token_ids[4]
    out = await generate(
        moe_engine, prompt, max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)
    )
    assert out.routed_experts is not None
    assert out.routed_experts.shape[0] == len(out.token_ids) <= 5
    np.testing.assert_array_equal(out.routed_experts, full.routed_experts[: len(out.token_ids)])


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(8, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)],
)
def test_expert_dtype_is_the_smallest_that_fits(num_experts: int, dtype: type) -> None:
    assert expert_dtype(num_experts) == np.dtype(dtype)


def test_tiny_moe_has_the_documented_shape(tiny_moe_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert model.config.num_experts == NUM_EXPERTS
    assert model.config.num_experts_per_tok == TOP_K
