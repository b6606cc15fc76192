"""compose.yaml and the Dockerfile, checked as far as can be without building or running images.

Debian's `docker-compose` 1.29 validates the file offline (no Docker daemon) and prints it
normalized (anchors merged, ports and durations in one form); the checks read that output.
Every `rollouts` command is parsed by the CLI's own parser, so a flag that does not exist fails
here and not in a container. The healthchecks are run against a real `rollouts api` and a real
`rollouts worker` (the synthetic engine standing in for the model's), so a check that could
never pass, or never fail, is caught. Under CI=true a missing docker-compose fails the test:
CI installs it (.ci/run). The Dockerfile's install lines are compared with pyproject.toml and
with README.md's install commands, which the images must build.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from store.redis_server import RedisServer, free_port
from workers.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
WORKERS = ("worker-cpu", "worker-gpu")
SERVICES = ("redis", "api", *WORKERS)  # the long-running ones


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    if exe is None:
        why = "docker-compose is not installed (Debian: apt-get install docker-compose)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must validate compose.yaml", pytrace=False)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTS_API_TOKEN"}
    done = subprocess.run([exe, "-f", "compose.yaml", "config"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, f"docker-compose config refused compose.yaml:\n{done.stderr}"
    parsed = yaml.safe_load(done.stdout)
    assert isinstance(parsed, dict)
    return parsed


def rollouts_argv(command: list[str]) -> list[str]:
    """The arguments of the `rollouts` command a service runs: its command itself, or the
    one a `sh -c` script execs."""
    if command[0] == "rollouts":
        return command[1:]
    assert command[:2] == ["sh", "-c"], command
    words = shlex.split(command[2])
    at = words.index("rollouts")
    assert words[at - 1] == "exec", "the shell must exec rollouts (signals reach it)"
    return words[at + 1 :]


def parse(command: list[str]) -> Any:
    try:
        return build_parser().parse_args(rollouts_argv(command))
    except SystemExit:  # argparse printed why on stderr
        pytest.fail(f"`rollouts` refuses {command}", pytrace=False)


def test_redis_is_durable_never_evicts_and_is_not_open_to_the_network(
    config: dict[str, Any],
) -> None:
    redis = config["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "always"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert flags["--no-appendfsync-on-rewrite"] == "no"  # fsync during rewrites too
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"]), redis["volumes"]
    assert [v.split(":")[0] for v in redis["volumes"]] == ["redis-data"]  # a named volume
    assert "redis-data" in config["volumes"]
    for port in redis.get("ports", []):
        host_ip = port.split(":")[0] if isinstance(port, str) else port.get("host_ip")
        assert host_ip == "127.0.0.1" or "--requirepass" in flags, (
            f"Redis published on all interfaces without a password: {port}"
        )


def test_every_rollouts_command_parses_and_the_services_are_supervised(
    config: dict[str, Any],
) -> None:
    services = config["services"]
    assert set(services) == {"redis", "model-init", "api", *WORKERS}
    for name in SERVICES:
        s = services[name]
        assert s["restart"] == "unless-stopped", name
        assert s["stop_grace_period"], name
        assert s["healthcheck"]["test"][0] == "CMD", name
    api = parse(services["api"]["command"])
    assert (api.command, api.host, api.redis) == ("api", "0.0.0.0", "redis://redis:6379/0")
    assert services["api"]["ports"] == [f"127.0.0.1:{api.port}:{api.port}/tcp"]
    assert f":{api.port}/healthz" in services["api"]["healthcheck"]["test"][-1]

    init = parse(services["model-init"]["command"])
    assert (init.command, init.moe) == ("make-tiny-model", True)
    assert services["model-init"]["volumes"] == ["models:/models:rw"]
    engines = {}
    for name in WORKERS:
        s, w = services[name], parse(services[name]["command"])
        assert (w.command, w.redis) == ("worker", "redis://redis:6379/0")
        engines[name] = w.engine
        # The model it names is the one model-init writes, in the volume both mount.
        assert w.model == init.dir and s["volumes"] == ["models:/models:ro"]
        assert s["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
        assert s["depends_on"]["redis"] == {"condition": "service_healthy"}
        assert w.metrics_port is not None and w.metrics_host == "0.0.0.0"
        assert f":{w.metrics_port}/metrics" in s["healthcheck"]["test"][-1]
        assert "ports" not in s  # metrics stay inside the project's network
    assert engines == {"worker-cpu": "cpu", "worker-gpu": "vllm"}


def test_the_gpu_worker_reserves_gpus_in_a_profile_of_its_own(config: dict[str, Any]) -> None:
    services = config["services"]
    gpu = services["worker-gpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["profiles"] == ["gpu"]
    # `docker compose up` without a profile starts everything else, GPU or not.
    assert [n for n, s in services.items() if "profiles" in s] == ["worker-gpu"]
    assert [n for n, s in services.items() if "deploy" in s] == ["worker-gpu"]
    targets = {n: s["build"]["target"] for n, s in services.items() if "build" in s}
    assert targets == {"model-init": "cpu", "api": "cpu", "worker-cpu": "cpu", "worker-gpu": "gpu"}
    assert set(targets.values()) <= set(dockerfile_stages())


# -- the healthchecks, run for real ----------------------------------------------------------
def healthy(test: list[str], port: int, real_port: int) -> bool:
    """Run a healthcheck's command here, with this interpreter, against ``real_port``."""
    assert test[:3] == ["CMD", "python", "-c"], test
    script = test[3].replace(f":{port}/", f":{real_port}/")
    assert script != test[3]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30,
                          check=False)  # fmt: skip
    return done.returncode == 0


def wait_healthy(test: list[str], port: int, real_port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not healthy(test, port, real_port):
        assert proc.poll() is None, f"the process exited with {proc.returncode}"
        assert time.monotonic() < deadline, "never healthy"
        time.sleep(0.3)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    # Its own server: a worker takes any job it finds in its queue.
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


def run(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "workers.cli", *argv], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.redis_server
def test_the_api_healthcheck_passes_on_a_live_api_and_fails_without_one(
    config: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    api = config["services"]["api"]
    args = rollouts_argv(api["command"])
    test, port, real = api["healthcheck"]["test"], parse(api["command"]).port, free_port()
    assert not healthy(test, port, real)
    argv = [*_set(args, "--redis", redis_url), "--port", str(real)]
    argv = _set(argv, "--host", "127.0.0.1")
    proc = run(argv, tmp_path / "api.log")
    try:
        wait_healthy(test, port, real, proc)
    finally:
        stop(proc)
    assert not healthy(test, port, real)


@pytest.mark.redis_server
def test_the_worker_healthcheck_passes_once_its_engine_is_up(
    config: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    worker = config["services"]["worker-cpu"]
    w = parse(worker["command"])
    test, real = worker["healthcheck"]["test"], free_port()
    assert config["services"]["worker-gpu"]["healthcheck"]["test"] == test
    argv = _set(rollouts_argv(worker["command"]), "--redis", redis_url)
    argv = _set(_set(argv, "--engine", "synthetic"), "--metrics-port", str(real))
    argv = _set(_drop(argv, "--model"), "--metrics-host", "127.0.0.1")
    proc = run(argv, tmp_path / "worker.log")
    try:
        wait_healthy(test, w.metrics_port, real, proc)
    finally:
        stop(proc)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    at = argv.index(flag)
    return [*argv[: at + 1], value, *argv[at + 2 :]]


def _drop(argv: list[str], flag: str) -> list[str]:
    at = argv.index(flag)
    return [*argv[:at], *argv[at + 2 :]]


# -- the Dockerfile -------------------------------------------------------------------------
def dockerfile_stages() -> dict[str, list[str]]:
    """Each stage's instructions, continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in filter(None, (ln.strip() for ln in joined.splitlines())):
        m = re.fullmatch(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, flags=re.IGNORECASE)
        if m:
            current = stages.setdefault(m.group(2), [f"FROM {m.group(1)}"])
        else:
            current.append(line)
    return stages


def pip_installs(stage: list[str]) -> list[list[str]]:
    """Every `pip install ...` of a stage's RUN lines, split into words."""
    out = []
    for line in stage:
        if line.startswith("RUN "):
            for part in line[4:].split("&&"):
                words = shlex.split(part)
                if words[:2] == ["pip", "install"]:
                    out.append(words[2:])
    return out


def extras(words: list[str]) -> set[str] | None:
    """The extras of the project installed by a `pip install` (`.[a,b]`), or None."""
    for w in words:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", w)
        if m:
            return set(m.group(1).split(","))
    return None


def readme_installs() -> list[set[str]]:
    """The extras of every `pip install ... '.[...]'` README.md tells a user to run, in order."""
    text = (REPO / "README.md").read_text()
    return [set(m.group(1).split(",")) for m in re.finditer(_README_INSTALL, text)]


_README_INSTALL = r"pip install (?:-e )?'\.\[([\w,-]+)\]'"


def test_the_cpu_image_installs_pytorchs_cpu_build_then_what_the_readme_installs() -> None:
    stages = dockerfile_stages()
    assert set(stages) >= {"base", "cpu", "gpu"}
    assert list(stages)[-1] == "cpu"  # `docker build .` without --target builds the CPU image
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cpu"]  # fmt: skip
    [torch_pin] = [p for p in pins if p.startswith("torch")]
    torch, project = pip_installs(stages["cpu"])
    # PyTorch's own index for the CPU build of exactly the pinned version, first: from PyPI
    # the pin resolves to the CUDA build.
    assert torch == ["--index-url", TORCH_CPU_INDEX, torch_pin.replace(" ", "")]
    readme = readme_installs()
    assert readme, "README.md names no `pip install '.[...]'`"
    # The README's first install (the demo's) minus the test tools is what the image runs.
    assert extras(project) == readme[0] - {"dev"} == {"cpu"}


def test_the_gpu_image_installs_the_readmes_vllm_extra_and_nothing_runs_online() -> None:
    stages = dockerfile_stages()
    [gpu] = pip_installs(stages["gpu"])
    assert extras(gpu) == {"vllm"} and {"vllm"} in readme_installs()
    assert stages["gpu"][0] == stages["cpu"][0] == "FROM base"
    base = " ".join(stages["base"])
    for setting in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_NO_USAGE_STATS=1"):
        assert setting in base
    for stage in ("cpu", "gpu"):
        assert stages[stage][-1] == "USER rollouts"
