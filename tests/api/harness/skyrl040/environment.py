"""The Python environment SkyRL 0.4.0's client runs in: Python >= 3.12 (SkyRL 0.4.0 requires
it; the project's venv is 3.11), ``skyrl==0.4.0`` without its dependencies (transformers,
datasets, peft, ... : the client needs none of them, and torch is replaced by the stand-in
of ``torch_standin``), plus the few packages the client module imports. Pinned to the versions
it was tested with.

Built once into a cache directory outside the repository (``~/.cache/durable-rollouts``,
``$ROLLOUTS_CACHE_DIR`` if set), under a file lock (pytest-xdist's processes may ask at
once); kept while it still imports the client. ``$ROLLOUTS_SKYRL040_PYTHON`` names a ready
interpreter instead (nothing is built).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PYTHON_ENV = "ROLLOUTS_SKYRL040_PYTHON"
CACHE_ENV = "ROLLOUTS_CACHE_DIR"
HERE = Path(__file__).resolve().parent
DRIVER = HERE / "driver.py"
SKYRL = "skyrl==0.4.0"
# What remote_inference_client.py imports (aiohttp, orjson, pybase64, numpy, pydantic, loguru,
# rich, cloudpathlib), at the versions tested.
DEPENDENCIES = (
    "aiohttp==3.14.5", "orjson==3.13.0", "pybase64==1.5.1", "numpy==2.5.5", "pydantic==2.14.4",
    "loguru==0.7.3", "rich==15.0.0", "cloudpathlib==0.26.0",
)  # fmt: skip
# SkyRL 0.4.0: Requires-Python >=3.12,<3.15.
VERSIONS = ("3.12", "3.13", "3.14")
# The client's import, with the stand-in torch first on the path: the check of an environment.
IMPORT_CHECK = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import "
    "RemoteGenerateClient, RemoteInferenceClient"
)


class Unavailable(Exception):
    """Why the environment cannot be had here (no Python >= 3.12, an install that failed)."""


def python() -> Path:
    """An interpreter that imports SkyRL 0.4.0's client: the one ``$ROLLOUTS_SKYRL040_PYTHON``
    names, or the cached environment's, built if missing or broken."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        why = import_error(Path(given))
        if why:
            raise Unavailable(f"{PYTHON_ENV}={given} does not import SkyRL 0.4.0's client: {why}")
        return Path(given)
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "durable-rollouts")
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / "skyrl-0.4.0"
    interpreter = venv / "bin" / "python"
    with _locked(cache / "skyrl-0.4.0.lock"):
        if interpreter.exists() and not import_error(interpreter):
            return interpreter
        build(venv, base_python())
        why = import_error(interpreter)
        if why:
            raise Unavailable(f"the environment built at {venv} does not import the client: {why}")
    return interpreter


def import_error(interpreter: Path) -> str | None:
    try:
        standin = str(HERE / "torch_standin")
        done = subprocess.run([str(interpreter), "-c", IMPORT_CHECK, standin],
                              check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    except OSError as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr[-2000:]


def base_python() -> str:
    """A Python of SkyRL 0.4.0's range: on PATH (pyenv shims included), or pyenv's."""
    candidates = [f"python{v}" for v in VERSIONS]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    for v in VERSIONS:
        candidates += [str(p / "bin" / "python") for p in sorted(pyenv.glob(f"{v}.*"))]
    for candidate in candidates:
        exe = shutil.which(candidate)
        if exe is None:
            continue
        # A pyenv shim of a version not selected exits non-zero: try the next.
        check = "import sys; assert (3, 12) <= sys.version_info[:2] < (3, 15)"
        if subprocess.run([exe, "-c", check], check=False, capture_output=True).returncode == 0:
            return exe
    raise Unavailable("no Python 3.12-3.14 found (python3.12 on PATH or under ~/.pyenv/versions)")


def build(venv: Path, base: str) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [base, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", SKYRL],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *DEPENDENCIES],
    )
    for step in steps:
        done = subprocess.run(step, check=False, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            output = done.stdout[-2000:] + done.stderr[-2000:]
            raise Unavailable(f"{' '.join(step)} failed:\n{output}")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
