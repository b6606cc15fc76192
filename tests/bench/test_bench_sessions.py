"""``bench/bench_sessions.py --json`` runs end to end at a small size and reports every figure: a
session's calls as one episode's turns against the same calls as a rollout each, on a real
worker and redis-server (it checks both sides' answers equal, or exits non-zero), and that the
episode stores less once a session has more than one call."""

from __future__ import annotations

import pytest

from tests.bench.smoke import assert_finite, figures

pytestmark = pytest.mark.redis_server

FIGURES = (
    "bytes_ratio",
    "log_bytes_ratio",
    "episode_bytes_per_session",
    "rollouts_bytes_per_session",
    "episode_log_bytes_per_session",
    "rollouts_log_bytes_per_session",
)


def test_a_small_run_reports_every_figure() -> None:
    result = figures(
        "bench_sessions.py", "--sessions", "1", "--turns", "4", "--system", "64",
        "--answer", "16", "--tool", "8",
    )  # fmt: skip
    assert_finite(result, FIGURES)
    # Four calls: the first prompt and three tool results stored once, not four prompts.
    assert 0.0 < result["log_bytes_ratio"] < 1.0
    assert 0.0 < result["bytes_ratio"] < 1.0
