"""The README's first command, `rollouts demo`, does what the README says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# The demo runs the API and CPU-engine worker processes on a real model (minutes here).
pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

# The Done-when numbers at the lowest cost: 3 steps x 8 prompts x 4 samples = 96 rollouts,
# 2 weight updates between the steps, 1 worker kill.
SMALL = ["--steps", "3", "--prompts", "8", "--samples", "4", "--max-tokens", "24"]


def _demo(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    script = Path(sys.executable).parent / "rollouts"  # the console script `pip install` made
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "workers.cli"]
    (tmp_path / "tmp").mkdir()
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(tmp_path / "tmp"),  # where the demo's temporary directory goes
    }
    return [*cmd, "demo", *args], env


def test_rollouts_demo_json(tmp_path: Path) -> None:
    cmd, env = _demo(tmp_path, "--json", *SMALL, "--plot", str(tmp_path / "t.png"))
    done = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # the whole stdout is one JSON object
    assert report["notes"], report  # what the loop did, in the order it did it
    print(json.dumps(report, indent=1))  # shown with a failure below
    assert report["mismatches"] == 0
    assert report["rollouts_submitted"] == report["rollouts_done"] == 96
    assert report["weight_updates"] == 2
    assert report["worker_kills"] == 1
    assert report["resumes"] >= 1 and report["aborts"] >= report["resumes"]
    assert report["aborts_by_reason"].get("worker_lost", 0) >= 1  # the kill interrupted work
    assert report["aborts_by_reason"].get("weight_update", 0) >= 1
    assert report["rollouts_multi_version"] >= 1  # some rollouts span two weight versions
    assert report["segments_checked"] >= report["rollouts_done"]
    assert report["tokens"] == 96 * 24
    assert report["api_url"].startswith("http://127.0.0.1:")
    assert report["plot"] == str(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary directory is gone


def test_ctrl_c_stops_every_process_and_removes_every_file(tmp_path: Path) -> None:
    cmd, env = _demo(tmp_path, *SMALL)
    demo = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        me = psutil.Process(demo.pid)
        # Mid-run: redis-server, the API and both workers are up, and rollouts generate.
        deadline = time.monotonic() + 300
        children: list[psutil.Process] = []
        while time.monotonic() < deadline:
            children = me.children(recursive=True)
            if sum("worker" in " ".join(c.cmdline()) for c in children) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the demo never started its workers")
        time.sleep(8)  # workers load the model and start generating
        children = me.children(recursive=True)
        assert len(children) >= 4  # redis-server, the API, two workers (and their engines)
        demo.send_signal(signal.SIGINT)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, out.decode()
    assert b"interrupted; stopped everything it started" in out
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], [c.cmdline() for c in alive]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not (tmp_path / "rollouts-timeline.png").exists()


def test_without_redis_server_on_path_it_says_how_to_install_it(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no redis-server there
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "demo"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "rollouts demo: needs redis-server on PATH (apt-get install redis-server, "
        "or brew install redis), or --redis URL"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written
