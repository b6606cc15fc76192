"""Measuring how long Redis is held: what a call cost it, and how long a worker's heartbeat
waited meanwhile (issue 28: a cancel of 100,000 rollouts held Redis for 7.3 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from store import scripts
from store.event_store import EventStore

ROOT = Path(__file__).resolve().parents[2]
# The most Redis may spend on one script or transaction (the bound), in seconds.
MAX_CALL_S = 0.050


class RedisCpu:
    """What each script, transaction or pipeline of scripts cost Redis: its main thread's CPU
    time (``INFO cpu``) before and after the call. Wall time (SLOWLOG) is no measure on a
    shared machine: it grows while redis-server waits for a CPU (single one-key commands took
    0.1-0.5 s under a load of 6-9 here); CPU time does not. The heartbeat's renewals in
    between cost ~20 us each."""

    def __init__(self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.info = redis.Redis.from_url(url)
        self.calls: list[tuple[str, float]] = []
        real_transaction, real_many = scripts.transaction, scripts.Script.many
        real_load = EventStore.load_many

        async def transaction(client: Any, steps: Any, **kw: Any) -> Any:
            return await self.timed("transaction", real_transaction(client, steps, **kw))

        async def many(script: scripts.Script, client: Any, calls: Any) -> Any:
            what = f"{script.name} x{len(calls)}"
            return await self.timed(what, real_many(script, client, calls))

        async def load_many(store: EventStore, ids: Any) -> Any:
            return await self.timed(f"load x{len(ids)}", real_load(store, ids))

        def windowed(client: Any, script: scripts.Script, calls: Any, **_: Any) -> list[Any]:
            # One call at a time (not two in flight), so that each is measured alone.
            def run(keys: Any, args: Any) -> Any:
                call = lambda: scripts.run_sync(client, script, keys, args)  # noqa: E731
                return self.timed_sync(script.name, call)

            return [run(keys, args) for keys, args in calls]

        monkeypatch.setattr(scripts, "transaction", transaction)
        monkeypatch.setattr(scripts.Script, "many", many)
        monkeypatch.setattr(EventStore, "load_many", load_many)
        monkeypatch.setattr(scripts, "run_windowed_sync", windowed)

    def now(self) -> float:
        cpu: dict[str, float] = self.info.info("cpu")  # type: ignore[assignment]
        return cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]

    async def timed(self, what: str, call: Any) -> Any:
        before = self.now()
        reply = await call
        self.calls.append((what, self.now() - before))
        return reply

    def timed_sync(self, what: str, call: Callable[[], Any]) -> Any:
        before = self.now()
        reply = call()
        self.calls.append((what, self.now() - before))
        return reply

    def close(self) -> None:
        self.info.close()

    def worst(self, n: int = 1) -> list[tuple[str, float]]:
        return sorted(self.calls, key=lambda c: -c[1])[:n]


class Heartbeat:
    """A worker's lease renewals, in a process of its own (``tests.store.renewals``)."""

    def __init__(self, url: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.store.renewals", url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def stop(self) -> dict[str, float]:
        out, _ = self.proc.communicate("", timeout=30)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]
