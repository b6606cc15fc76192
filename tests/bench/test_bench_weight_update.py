"""``bench/bench_weight_update.py --quick --json`` runs end to end and reports every figure.

It once waited forever without a word: its engine wrapper had no ``model_id``, the worker task
died at start, and nothing watched it (issue 29)."""

from __future__ import annotations

import pytest

from tests.bench.smoke import assert_finite, figures

# It starts a redis-server, builds a tiny model and starts a CPU engine (~10-16 s here).
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

FIGURES = (
    "resume_s",
    "abort_persist_s",
    "load_s",
    "reprefill_s",
    "tokens_kept",
    "tokens_discarded",
    "baseline_tokens_discarded",
    "baseline_resume_s",
)


def test_quick_bench_reports_every_figure() -> None:
    result = figures("bench_weight_update.py", "--quick")
    assert_finite(result, FIGURES)
    assert result["interface"] == "steps"  # the worker's default on the CPU engine
    # Every rollout had its tokens before the update, and kept them.
    before = result["rollouts_in_flight"] * result["tokens_before_update_min"]
    assert result["tokens_kept"] >= before
