"""The README's episode example end to end: ``python -m examples.calculator_episode --json``
runs a 3-turn episode on the CPU engine with a worker SIGKILLed mid-turn and an environment
runner SIGKILLed mid-call, and reports it equal to the uninterrupted episode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.redis_server
def test_the_calculator_episode_survives_both_kills_and_equals_the_uninterrupted_one() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "examples.calculator_episode", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["status"] == "done" and report["finish_reason"] == "max_turns"
    assert report["equals_uninterrupted"] is True
    assert [t["tokens"][1] - t["tokens"][0] for t in report["turns"]] == [24, 24, 24]
    assert report["worker_killed_at_token"] > 24  # in turn 2, after a checkpoint of it
    first, second, third = report["calls"]
    assert [c["ended"] for c in first["claims"]] == ["result"]
    # The runner killed mid-call: its claim lost with the effect unverified, run again.
    assert [(c["ended"], c["decision"]) for c in second["claims"]] == [
        ("lost", "idempotent"),
        ("result", None),
    ]
    assert third["claims"] == [] and third["observation"] == []  # the max_turns budget
    counts = sorted(report["calculator_executions"].values())
    assert counts == [1, 2]  # call 1 ran once, call 2 twice (idempotent), call 3 never
