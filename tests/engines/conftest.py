"""Tiny model directories and engine factories shared by the engine tests."""

from __future__ import annotations

import os

# Set before anything imports huggingface_hub/transformers (they read these at import): a
# test that tried to reach a hub fails loudly instead of downloading.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import dataclasses  # after the offline switches on purpose
import json
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engine_pool import EnginePool
from workers.demo.tiny_model import make_tiny_checkpoint
from workers.engines.base import Engine


@dataclass(frozen=True)
class EngineCase:
    """One engine under the contract suite: how to build it, and what it can promise.

    `logprob_tol` bounds logprob differences between runs of one engine that split the same
    sequence differently (resume, other requests in flight): the CPU engine is bit-exact, so
    1e-5 is generous; vLLM cases may need more.
    """

    name: str
    moe: bool
    # The session fixture whose `EnginePool` (tests/engine_pool.py) starts, shares and
    # closes this case's engines: every engine is seconds to start.
    pool_fixture: str
    logprob_tol: float = 1e-5
    # vs a direct full-sequence HF forward, whose kernels round differently: measured
    # <= 5e-5 over 64 tokens of the tiny MoE (1e-5 dense), so 2e-4 leaves margin.
    hf_logprob_tol: float = 2e-4
    # Whether a MoE engine returns routed experts (vLLM can only on GPU).
    routed_experts: bool = True
    marks: tuple[Any, ...] = ()

    @property
    def routes(self) -> bool:
        return self.moe and self.routed_experts


def _vllm_case(moe: bool) -> EngineCase:
    # vLLM on CPU, float32. Its kernels (oneDNN GEMMs, its own attention, batched decode)
    # round differently from torch's, so the tolerances are 10x the CPU engine's; the suite
    # passes at these (the largest differences were not recorded).
    return EngineCase(
        name=f"vllm-{'moe' if moe else 'dense'}",
        moe=moe,
        pool_fixture="vllm_pool",
        logprob_tol=1e-4,
        hf_logprob_tol=1e-3,
        routed_experts=False,  # enable_return_routed_experts needs Triton (GPU)
        marks=(pytest.mark.vllm,),
    )


ENGINE_CASES = [
    EngineCase(name="cpu-dense", moe=False, pool_fixture="cpu_pool"),
    # The fast tier (-m "not slow") keeps the dense CPU case: the contract on a real model.
    EngineCase(name="cpu-moe", moe=True, pool_fixture="cpu_pool", marks=(pytest.mark.slow,)),
    _vllm_case(moe=False),
    _vllm_case(moe=True),
    # Over HTTP, the MoE model only (the harder reload): each model directory the suite
    # uses needs its own server process (30-60 s to start here).
    dataclasses.replace(
        _vllm_case(moe=True),
        name="vllm-http-moe",
        pool_fixture="vllm_server_pool",
        marks=(pytest.mark.vllm, pytest.mark.vllm_server),
    ),
]


# Session scope makes pytest run each case's tests together, so an expensive engine (vLLM)
# is started once per case and not once per test.
@pytest.fixture(
    scope="session",
    params=[pytest.param(c, marks=c.marks, id=c.name) for c in ENGINE_CASES],
)
def engine_case(request: pytest.FixtureRequest) -> EngineCase:
    return request.param


@pytest.fixture
def model_dir(engine_case: EngineCase, request: pytest.FixtureRequest) -> Path:
    name = "tiny_moe_dir" if engine_case.moe else "tiny_dense_dir"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def _checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    return {}


@pytest.fixture
def second_checkpoint(
    model_dir: Path, _checkpoints: dict[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Same architecture, different weights (seed 1): the target of weight updates.

    One per model for the session (deterministic content), so pooled engines started on it
    are reused across tests."""
    if model_dir not in _checkpoints:
        _checkpoints[model_dir] = make_tiny_checkpoint(
            tmp_path_factory.mktemp("v2") / "v2", like=model_dir, seed=1
        )
    return _checkpoints[model_dir]


@pytest.fixture
def engine_pool(engine_case: EngineCase, request: pytest.FixtureRequest) -> EnginePool:
    """The case's engine pool (resolved here, outside any running loop)."""
    pool: EnginePool = request.getfixturevalue(engine_case.pool_fixture)
    return pool


# Session loop: pooled vLLM engines are bound to the loop that first used them.
@pytest_asyncio.fixture(loop_scope="session")
async def engines(engine_pool: EnginePool) -> Callable[..., Awaitable[Engine]]:
    """`await engines(model_dir, weight_version=0)`: an idle engine on those weights."""

    async def get(model_dir: Path, *, weight_version: int = 0) -> Engine:
        engine: Engine = await engine_pool.get(model_dir, weight_version)
        return engine

    return get


@pytest_asyncio.fixture(loop_scope="session")
async def engine(engines: Callable[..., Awaitable[Engine]], model_dir: Path) -> Engine:
    return await engines(model_dir)


@pytest.fixture
def with_eos(model_dir: Path, tmp_path: Path) -> Callable[[int], Path]:
    """`with_eos(token_id)`: a copy of the model whose eos is that token (random models
    rarely emit their real eos, so tests pick a token they do emit)."""

    def make(eos_token_id: int) -> Path:
        dest = tmp_path / f"eos{eos_token_id}"
        shutil.copytree(model_dir, dest)
        for name in ("config.json", "generation_config.json"):
            data = json.loads((dest / name).read_text())
            data["eos_token_id"] = eos_token_id
            (dest / name).write_text(json.dumps(data))
        return dest

    return make
