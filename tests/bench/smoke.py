"""A benchmark run as its user runs it: ``python bench/NAME.py ... --json``, its figures one JSON
object on the last line of its output."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def run(script: str, *args: str, timeout: float = 240, env: Mapping[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json"],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT, env=env,
    )  # fmt: skip


def figures(script: str, *args: str, timeout: float = 240,
            env: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Its figures; fails with its output if it exited non-zero."""
    done = run(script, *args, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_finite(result: Mapping[str, Any], names: Iterable[str]) -> None:
    """Each of ``names`` is in ``result`` as a finite number (figures are printed, not judged)."""
    for name in names:
        value = result[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        assert ok and math.isfinite(value), (name, value)
