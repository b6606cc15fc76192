"""The README's first command, `rollouts demo`, does what the README says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The demo runs CPU-engine worker processes on a real model (about a minute here).
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


def test_rollouts_demo(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "rollouts"  # the console script `pip install` made
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "workers.cli"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [*cmd, "demo"], env=env, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all match the uninterrupted greedy run token for token" in done.stdout
    resumed = int(done.stdout.split(" rollouts were interrupted and resumed")[0].split()[-1])
    assert resumed >= 1
