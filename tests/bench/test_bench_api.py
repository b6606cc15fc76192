"""``bench/bench_api.py --quick --json`` runs end to end and reports every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# It starts a redis-server and an API process (~6 s here).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_api.py"
FIGURES = (
    "api_ratio",
    "api_ratio_json",
    "submit_ratio_msgpack",
    "submit_ratio_json",
    "stream_ratio_msgpack",
    "stream_ratio_json",
    "submit_client_per_s",
    "stream_client_per_s",
    "stream_http_p99_ms",
    "stream_python_p99_ms",
)


def test_quick_bench_reports_every_figure() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"],
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in FIGURES:
        value = result[name]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, name
    # The added latency may be negative on a sample (HTTP first): finite is what is asked.
    assert math.isfinite(result["stream_added_p99_ms"])
    assert result["stream_rollouts"] == 200 and result["latency_rollouts"] == 40
