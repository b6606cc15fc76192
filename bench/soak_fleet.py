"""The soak's processes: the demo's (``workers.demo.run.Processes``: the API, stop-all on the way
out) plus worker slots, each with a role that its replacements keep.

- ``clock``: the worker runs under libfaketime, its wall clock offset by whatever the soak
  writes into a timestamp file (``FAKETIME_TIMESTAMP_FILE`` with ``FAKETIME_NO_CACHE=1``: read
  at every call, so a step lands at once); its monotonic clock is left alone
  (``FAKETIME_DONT_FAKE_MONOTONIC=1``, the name libfaketime 0.9.10 reads; older releases read
  ``DONT_FAKE_MONOTONIC``, set too). Such a process also gets ``tests/workers/faketime_shim``
  first on its PYTHONPATH: with the monotonic clock left alone, libfaketime 0.9.10 turns Python
  3.11's ``time.sleep`` (``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``) into EINVAL
  (wolfcw/libfaketime#426); its ``sitecustomize`` sleeps another way.
- ``link``: the worker reaches Redis through the soak's ``LinkProxy`` (every connection: its
  pool, its presence subscription, rq's).
- ``plain``: neither.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from store.connection import URL_ENV
from workers import worker_cli
from workers.demo import run as demo
from workers.engine_factory import SYNTHETIC_ARGS_ENV

# A sitecustomize whose time.sleep works under libfaketime 0.9.10 (see its docstring); the
# clock-skew tests' workers load it too.
SHIM = Path(__file__).resolve().parents[1] / "tests" / "workers" / "faketime_shim"
LIBFAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/libfaketimeMT.so.1",
)
ROLES = ("clock", "link")  # the first slots; any further slot is plain
TERM_WAIT_S = 45.0  # a SIGTERMed worker saves within SHUTDOWN_GRACE_S (30 s); then SIGKILL


def find_libfaketime() -> str | None:
    for pattern in LIBFAKETIME_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


@dataclass(slots=True)
class Slot:
    index: int
    role: str  # clock | link | plain
    name: str = ""
    proc: subprocess.Popen[bytes] | None = None
    generation: int = 0


class Fleet(demo.Processes):
    def __init__(
        self,
        url: str,
        model: Path | None,
        logs: Path,
        *,
        workers: int,
        concurrency: int,
        synthetic: dict[str, object],
        link_url: str | None,
        clock_file: Path | None,
        libfaketime: str | None,
        extra: tuple[str, ...] = (),
    ) -> None:
        super().__init__(url, model or Path(), logs)
        self.engine = "cpu" if model is not None else "synthetic"
        self.concurrency = concurrency
        self.synthetic = synthetic
        self.link_url, self.clock_file, self.libfaketime = link_url, clock_file, libfaketime
        self.extra = extra
        roles = [r for r in ROLES if (r != "link" or link_url) and (r != "clock" or clock_file)]
        self.slots = [Slot(i, roles[i] if i < len(roles) else "plain") for i in range(workers)]
        self.term_overran: list[str] = []  # SIGTERMed workers that had to be SIGKILLed
        self.faked: list[subprocess.Popen[bytes]] = []  # processes started under libfaketime

    # -- starting ---------------------------------------------------------------------------
    def start(self, slot: Slot) -> str:
        slot.generation += 1
        slot.name = f"soak-{slot.role}{slot.index}-{slot.generation}"
        cmd = worker_cli.command(
            None, self.model if self.engine == "cpu" else "", slot.name,
            "--checkpoint-tokens", "8", *self.extra,
            concurrency=self.concurrency, engine=self.engine,
        )  # fmt: skip
        slot.proc = self._spawn(cmd, f"{slot.name}.log", self._env(slot.role))
        self.workers[slot.name] = slot.proc
        if slot.role == "clock":
            self.faked.append(slot.proc)
        return slot.name

    def start_all(self) -> None:
        for slot in self.slots:
            self.start(slot)

    def _env(self, role: str) -> dict[str, str]:
        env = {**self.env, SYNTHETIC_ARGS_ENV: json.dumps(self.synthetic)}
        if role == "link" and self.link_url:
            env[URL_ENV] = self.link_url
        if role == "clock" and self.clock_file and self.libfaketime:
            path = [str(SHIM), *filter(None, [env.get("PYTHONPATH")])]
            env.update(
                LD_PRELOAD=self.libfaketime,
                FAKETIME_TIMESTAMP_FILE=str(self.clock_file),
                FAKETIME_NO_CACHE="1",
                FAKETIME_DONT_FAKE_MONOTONIC="1",
                DONT_FAKE_MONOTONIC="1",
                # Off: on glibc >= 2.30 libfaketime 0.9.10's forced "monotonic fix" expires
                # every timed wait on a monotonic condition variable at once, Python's GIL
                # among them, and the process ran ~25x slower with two threads busy (its
                # leases lapsed, its reconnects took seconds). tests/workers/test_clock_skew.py
                # sets the same and tests it.
                FAKETIME_FORCE_MONOTONIC_FIX="0",
                PYTHONPATH=os.pathsep.join(path),
            )
        return env

    def _spawn(self, cmd: list[str], log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        # As demo.Processes._popen, with an environment of the slot's own: a session of its
        # own (a Ctrl-C reaches the soak only; its engine process goes with it).
        p = subprocess.Popen(
            cmd,
            stdout=(self.logs / log).open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.all.append(p)
        return p

    # -- faults -----------------------------------------------------------------------------
    def sigkill(self, slot: Slot) -> str:
        """SIGKILL the slot's worker (its engine process with it) and start a replacement."""
        name, proc = slot.name, slot.proc
        assert proc is not None
        demo._signal_group(proc, signal.SIGKILL)
        proc.wait()
        self.forget_faked()
        self.start(slot)
        return name

    def sigterm(self, slot: Slot) -> tuple[str, subprocess.Popen[bytes]]:
        """SIGTERM the slot's worker and start its replacement at once (the stopping worker
        saves and requeues its rollouts meanwhile); the caller waits for the exit."""
        name, proc = slot.name, slot.proc
        assert proc is not None
        demo._signal_group(proc, signal.SIGTERM)
        self.start(slot)
        return name, proc

    def reap_stopped(self, name: str, proc: subprocess.Popen[bytes]) -> int:
        """Wait for a SIGTERMed worker (blocking; bounded): its exit code, or -9 if it had to
        be killed."""
        try:
            return proc.wait(TERM_WAIT_S)
        except subprocess.TimeoutExpired:
            self.term_overran.append(name)
            demo._signal_group(proc, signal.SIGKILL)
            proc.wait()
            return -9

    def stop_all(self) -> None:
        super().stop_all()
        self.forget_faked()

    def forget_faked(self) -> None:
        """Remove what libfaketime leaves in /dev/shm when its process dies without exiting
        (SIGKILL): a semaphore and a shared segment named by the pid, ours only."""
        for p in [p for p in self.faked if p.poll() is not None]:
            for name in (f"faketime_shm_{p.pid}", f"sem.faketime_sem_{p.pid}"):
                with contextlib.suppress(FileNotFoundError):
                    # It exited cleanly and removed them itself.
                    os.unlink(f"/dev/shm/{name}")
            self.faked.remove(p)

    def log_lines(self, needle: str) -> int:
        """Lines holding ``needle`` across every log (workers and API)."""
        n = 0
        for f in self.logs.glob("*.log"):
            with f.open("rb") as fh:
                n += sum(needle.encode() in line for line in fh)
        return n
