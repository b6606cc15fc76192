"""Under pytest-xdist (`-n N --dist loadgroup`) every vLLM test runs in one process.

tests/vllm_plugin.py marks each vLLM test with one xdist group, so the session's pooled engines
start once and never twice at a time (each holds ~1.4 GB and its start is ~20 s of CPU). That
silently stopped working once (pytest 9.2 with pytest-xdist 3.8, pytest-xdist#1386): all three
processes started engines of their own. This runs a small suite through the plugin and reads
which process ran each test, and in which order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = 'pytest_plugins = ["tests.vllm_plugin"]\n'
BODY = """
import os, pytest, time
{mark}
@pytest.mark.parametrize("i", range(3))
def test_{name}(i):
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(f"{name} {{os.environ['PYTEST_XDIST_WORKER']}} {{time.monotonic()}}\\n")
    time.sleep(0.2)
"""


@pytest.mark.vllm  # the plugin skips its vLLM tests where vLLM is not installed
def test_vllm_tests_share_one_xdist_process(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name, mark in [
        ("a_plain", ""),
        ("b_engine", "pytestmark = pytest.mark.vllm"),
        ("c_plain", ""),
        ("d_server", "pytestmark = [pytest.mark.vllm, pytest.mark.vllm_server]"),
    ]:
        (suite / f"test_{name}.py").write_text(BODY.format(mark=mark, name=name))
    log = tmp_path / "ran.log"
    env = {**os.environ, "RAN_LOG": str(log), "PYTHONPATH": str(ROOT)}
    args = ["-q", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(suite), str(suite)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 12
    vllm_rows = sorted((float(t), name) for name, _, t in rows if name in ("b_engine", "d_server"))
    # One process ran every vLLM test, the in-process engine tests before the server tests.
    assert len({w for name, w, _ in rows if name in ("b_engine", "d_server")}) == 1
    assert [name for _, name in vllm_rows] == ["b_engine"] * 3 + ["d_server"] * 3
