"""``bench/bench_overhead.py --quick --json`` runs every part end to end (the CPU engine side
by side, short rollouts, the synthetic ceiling, GPU cadence) and reports every figure."""

from __future__ import annotations

import pytest

from tests.bench.smoke import assert_finite, figures

# It starts a redis-server, builds a tiny model and starts a CPU engine (~13 s here).
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

FIGURES = (
    "ratio",
    "direct_tokens_per_s",
    "durable_tokens_per_s",
    "worker_added_cpu_us_per_token",
    "short_ratio",
    "ceiling_tokens_per_s",
    "ceiling_engine_alone_tokens_per_s",
    "gpu_cadence_16_ratio",
    "gpu_cadence_16_tokens_per_s",
    "gpu_cadence_16_engine_alone_tokens_per_s",
    "gpu_cadence_16_added_cpu_us_per_token",
)


def test_quick_bench_reports_every_figure() -> None:
    result = figures("bench_overhead.py", "--quick")
    assert_finite(result, FIGURES)
    # Both sides did the same work (the benchmark checks their tokens are equal) in each pair.
    assert len(result["ratio_each"]) == result["rounds"] == 2
