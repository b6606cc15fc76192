"""``bench/bench_client.py --quick --json`` runs end to end and reports every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# It starts a redis-server and two synthetic-engine worker processes (~15-35 s here).
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_client.py"
FIGURES = (
    "submit_ratio",
    "submit_rollouts_per_s",
    "raw_xadd_per_s",
    "raw_xadd_multi_per_s",
    "delivery_p50_ms",
    "delivery_p99_ms",
    "take_k_speedup",
    "memory_after_ack_ratio",
    "bytes_per_inflight_token",
    "bytes_per_finished_1k_rollout_48x8",
)


def test_quick_bench_reports_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in FIGURES:
        value = result[name]
        assert isinstance(value, int | float) and math.isfinite(value), (name, value)
        assert value > 0, (name, value)
    # Every rollout delivered, and nothing of them left in Redis once acknowledged.
    assert result["delivery_completions"] == 100
    assert result["keys_added_after_ack"] == []
