"""Tiny model directories and engine factories shared by the engine tests."""

from __future__ import annotations

import os

# Set before anything imports huggingface_hub/transformers (they read these at import): a
# test that tried to reach a hub fails loudly instead of downloading.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import json  # after the offline switches on purpose
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from workers.engines.base import Engine
from workers.engines.cpu import CpuEngine
from workers.tiny_model import make_tiny_checkpoint


@dataclass(frozen=True)
class EngineCase:
    """One engine under the contract suite: how to build it, and what it can promise.

    `logprob_tol` bounds logprob differences between runs of one engine that split the same
    sequence differently (resume, other requests in flight): the CPU engine is bit-exact, so
    1e-5 is generous; vLLM cases may need more.
    """

    name: str
    moe: bool
    build: Callable[[Path, int], Awaitable[Engine]]
    logprob_tol: float = 1e-5
    # vs a direct full-sequence HF forward, whose kernels round differently: measured
    # <= 5e-5 over 64 tokens of the tiny MoE (1e-5 dense), so 2e-4 leaves margin.
    hf_logprob_tol: float = 2e-4


async def _build_cpu(model_dir: Path, weight_version: int) -> Engine:
    return CpuEngine(model_dir, weight_version=weight_version)


# vLLM engines join here as more params when they exist.
ENGINE_CASES = [
    EngineCase(name="cpu-dense", moe=False, build=_build_cpu),
    EngineCase(name="cpu-moe", moe=True, build=_build_cpu),
]


@pytest.fixture(params=ENGINE_CASES, ids=[c.name for c in ENGINE_CASES])
def engine_case(request: pytest.FixtureRequest) -> EngineCase:
    return request.param


@pytest.fixture
def model_dir(engine_case: EngineCase, request: pytest.FixtureRequest) -> Path:
    name = "tiny_moe_dir" if engine_case.moe else "tiny_dense_dir"
    return request.getfixturevalue(name)


@pytest.fixture
def second_checkpoint(model_dir: Path, tmp_path: Path) -> Path:
    """Same architecture, different weights (seed 1): the target of weight updates."""
    return make_tiny_checkpoint(tmp_path / "v2", like=model_dir, seed=1)


class _EngineFactory:
    def __init__(self, case: EngineCase) -> None:
        self.case = case
        self.built: list[Engine] = []

    async def __call__(self, model_dir: Path, *, weight_version: int = 0) -> Engine:
        engine = await self.case.build(model_dir, weight_version)
        self.built.append(engine)
        return engine

    async def close_all(self) -> None:
        for engine in self.built:
            await engine.close()


@pytest.fixture
async def engines(engine_case: EngineCase) -> AsyncIterator[_EngineFactory]:
    factory = _EngineFactory(engine_case)
    yield factory
    await factory.close_all()


@pytest.fixture
async def engine(engines: _EngineFactory, model_dir: Path) -> Engine:
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
