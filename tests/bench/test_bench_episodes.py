"""``bench/bench_episodes.py --json`` runs end to end at a small size and reports every figure:
the same turns through a real worker and environment loops as on the engine alone (it
checks the contexts equal, or exits non-zero), the ratio, time and Redis bytes per turn and
per call, and the stored bytes of observations over their payload."""

from __future__ import annotations

import pytest

from tests.bench.smoke import assert_finite, figures

pytestmark = pytest.mark.redis_server

FIGURES = (
    "ratio",
    "observation_bytes_ratio",
    "seconds_per_turn_direct",
    "seconds_per_turn_durable",
    "added_ms_per_turn",
    "redis_bytes_per_turn",
    "redis_bytes_per_tool_call",
    "tokens_per_turn",
)


def test_a_small_run_reports_every_figure() -> None:
    result = figures(
        "bench_episodes.py", "--episodes", "2", "--turns", "3", "--rounds", "2",
        "--token-ms", "2", "--observation", "16",
    )  # fmt: skip
    assert_finite(result, FIGURES)
    assert result["episodes_checked"] == 2 and len(result["ratios"]) == 2
    # 16-token observations: 64 bytes of payload each, stored in a record of ~120 bytes more.
    assert 1.0 < result["observation_bytes_ratio"] < 4.0


def test_the_direct_side_through_the_engines_steps_does_the_same_turns() -> None:
    """``--direct steps``: the engine driven through its whole steps, as the worker drives it
    (the contexts are checked equal to the durable side's, or the run exits non-zero)."""
    result = figures(
        "bench_episodes.py", "--episodes", "2", "--turns", "3", "--rounds", "2",
        "--token-ms", "2", "--observation", "16", "--direct", "steps",
    )  # fmt: skip
    assert_finite(result, FIGURES)
    assert result["workload"]["direct"] == "steps" and result["episodes_checked"] == 2
