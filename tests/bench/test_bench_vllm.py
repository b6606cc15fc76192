"""``bench/bench_vllm.py``'s measurement at its ``--quick`` size on real in-process vLLM, and
every figure it reports.

In this process, on the tests' pooled engine of the tiny MoE model, not as a subprocess: an
engine's start is ~35 of a quick run's ~47 s here, and a second engine beside the pool's would
hold another ~1.4 GB. What it leaves out is ``main``'s own few lines (the engine's options,
the header fields)."""

from __future__ import annotations

from pathlib import Path

import bench_vllm
import pytest

from store.redis_server import RedisServer
from tests.bench.smoke import assert_finite

pytestmark = [pytest.mark.vllm, pytest.mark.redis_server, pytest.mark.asyncio(loop_scope="session")]

FIGURES = (
    "warmup_s",
    "ratio",
    "direct_tokens_per_s",
    "durable_tokens_per_s",
    "worker_added_cpu_us_per_token",
    "cpu_added_share_of_a_core",
    "cpu_matched_ratio",
    "ratio_beyond_cpu",
    "core_busy_ratio",
)


async def test_quick_bench_reports_every_figure(
    vllm_pool, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    args = bench_vllm.arguments(["--quick", "--json"])
    engine = await vllm_pool.get(tiny_moe_dir)
    with RedisServer(tmp_path / "redis") as server:
        result = await bench_vllm.measure(engine, server, args)
    assert_finite(result, FIGURES)
    assert len(result["ratio_each"]) == args.rounds == 2
    print(result)
