"""``bench/bench_store.py --quick --json`` runs end to end and reports every figure."""

from __future__ import annotations

import pytest

from tests.bench.smoke import assert_finite, figures

# It starts a redis-server (~1-2 s here).
pytestmark = pytest.mark.redis_server

FIGURES = (
    "store_events_per_s",
    "store_tokens_per_s",
    "raw_events_per_s",
    "ratio",
    "raw_redis_cpu_us_per_event",
    "store_redis_cpu_us_per_event",
    "redis_cpu_ratio",
    "concurrent_store_events_per_s",
    "concurrent_ratio",
    "record_bytes_per_event",
    "payload_bytes_per_token",
    "redis_bytes_per_token",
    "raw_redis_bytes_per_token",
    "memory_ratio",
)


def test_quick_bench_reports_every_figure() -> None:
    result = figures("bench_store.py", "--quick")
    assert_finite(result, FIGURES)
    assert result["events"] == 16 * 4 and result["rounds"] == 1
