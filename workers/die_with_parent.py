"""Engine processes that end when the worker that started them dies, however it dies.

vLLM's AsyncLLM runs its EngineCore (and that its VLLM::Worker processes) as child processes.
When the worker is SIGKILLed (a preempted node's OOM killer, ``kill -9``, a crashed runtime)
nothing in it runs, and vLLM's own cleanup never happens: those children lived on forever,
~1.5 GB each here, and on a GPU they keep the memory the restarted worker needs (a known
vLLM issue, vllm-project/vllm#19849). Linux can do it for us: ``PR_SET_PDEATHSIG`` asks the
kernel to SIGKILL a process when its parent exits.

vLLM loads its "general plugins" in every process it starts (the EngineCore and each worker
process), so ``register`` is declared as one in ``pyproject.toml``. It acts only where the
worker asked for it, through ``ENV`` in the environment the children inherit: a vLLM server
someone started from a shell must not die with that shell.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

ENV = "ROLLOUTS_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

log = logging.getLogger("rollouts.engines")


def register() -> None:
    """vLLM's plugin hook: run in each of its processes."""
    if os.environ.get(ENV) == "1" and os.getpid() != _owner_pid():
        die_with_parent()


def ask_children_to_die_with_me() -> None:
    """Called by the worker before it starts an engine whose processes should not outlive it."""
    os.environ[ENV] = "1"
    os.environ[f"{ENV}_OWNER"] = str(os.getpid())


def die_with_parent() -> bool:
    """SIGKILL this process when its parent exits. False where the OS cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        # Not permitted here (it always is for one's own process on Linux): say so, go on.
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != parent:
        # The parent died between fork and prctl: the signal will never come.
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _owner_pid() -> int:
    """The worker itself loads vLLM's plugins too; it must not die with its own parent."""
    try:
        return int(os.environ.get(f"{ENV}_OWNER", "0"))
    except ValueError:
        return 0
