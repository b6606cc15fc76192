"""The soak's faults, dealt at random moments from a shuffled deck of every kind.

A deck (every kind once, shuffled; dealt, then shuffled again) rather than independent draws:
a one-minute soak meets every kind of fault, and a long one meets each equally often. Faults
come ``every_s`` apart on average (uniformly 0.5x-1.5x).

- ``sigkill``: SIGKILL a worker holding leases (else any), start a replacement in its slot;
- ``sigterm``: the same with SIGTERM (it saves and requeues; its exit is awaited, bounded);
- ``redis_restart``: SIGKILL or SIGTERM redis-server (AOF ``appendfsync always``), start it
  again on the same port and data directory;
- ``weight_update``: publish the next weight version mid-step;
- ``clock_step``: step the ``clock`` worker's wall clock by +-10 s or +-30 s for 10-20 s, then
  back (two steps);
- ``oom``: ``CONFIG SET maxmemory`` just above the memory in use (``noeviction``: writes that
  need memory are refused) for 2-5 s, then lifted;
- ``slow_link``: the ``link`` worker's connections get 50-200 ms of latency each way and are
  dropped now and then (0.05 per connection per second) for 15-30 s.

Spells (clock, oom, link) end on their own; ``restore`` ends any still running when the fault
phase is over, so the drain runs on a healthy system.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from redis.asyncio import Redis
from soak_fleet import Fleet, Slot
from soak_link import CLEAN, LinkMode, LinkProxy
from soak_trainer import Weights, retrying

from statemachine import LIVE
from store.event_store import EventStore
from store.leases import Leases
from store.redis_server import RedisServer

KINDS = (
    "sigkill", "sigterm", "redis_restart", "weight_update", "clock_step", "oom", "slow_link",
)  # fmt: skip
CLOCK_STEPS_S = (10, -10, 30, -30)
CLOCK_HOLD_S = (10.0, 20.0)
OOM_HOLD_S = (2.0, 5.0)
# Above the memory in use when set: the next few checkpoints fit, then writes are refused.
OOM_MARGIN_BYTES = 64 * 1024
LINK_SLOW = LinkMode(latency_s=(0.05, 0.2), drops_per_s=0.05)
LINK_HOLD_S = (15.0, 30.0)


def write_clock(path: Path, offset_s: int) -> None:
    """libfaketime's offset, e.g. ``+10s``; replaced whole (it reads the file at every call)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{offset_s:+d}s\n")
    os.replace(tmp, path)


class Faults:
    def __init__(
        self,
        *,
        rng: random.Random,
        kinds: tuple[str, ...],
        every_s: float,
        fleet: Fleet,
        server: RedisServer,
        admin: Redis,
        weights: Weights,
        proxy: LinkProxy | None,
        clock_file: Path | None,
        counts: Counter[str],
        say: Callable[[str], None],
    ) -> None:
        self.rng, self.kinds, self.every_s = rng, kinds, every_s
        self.fleet, self.server, self.admin, self.weights = fleet, server, admin, weights
        self.proxy, self.clock_file = proxy, clock_file
        self.counts = counts  # the trainer's retries: the faults' own calls retry too
        self.say = say
        self.injected: Counter[str] = Counter()
        self.timeline: list[tuple[float, str]] = []
        self.failed: list[str] = []  # faults that could not be injected, and why
        # (rollout, attempt) live on a worker when it was SIGKILLed / SIGTERMed.
        self.killed_attempts: set[tuple[str, int]] = set()
        self.stopped_attempts: set[tuple[str, int]] = set()
        self._deck: list[str] = []
        self._spells: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[object]] = set()
        self._t0 = time.monotonic()

    async def run(self, until: float) -> None:
        while self.kinds:  # none: a control run
            wait = self.every_s * self.rng.uniform(0.5, 1.5)
            if time.monotonic() + wait >= until:
                break
            await asyncio.sleep(wait)
            kind = self._deal()
            try:
                what = await self._inject(kind)
            except Exception as exc:
                # Recorded, never fatal: the soak goes on and the report names it.
                self.failed.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            self.injected[kind] += 1
            self.timeline.append((round(time.monotonic() - self._t0, 1), what))
            self.say(f"  fault: {what}")
        await asyncio.sleep(max(0.0, until - time.monotonic()))

    def _deal(self) -> str:
        if not self._deck:
            self._deck = list(self.kinds)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    async def _inject(self, kind: str) -> str:
        if kind == "sigkill":
            slot = await self._busy_slot()
            victim = slot.name
            live = await self._live_attempts(victim)
            await asyncio.to_thread(self.fleet.sigkill, slot)
            # Read again once it is dead: an attempt it opened meanwhile was lost too.
            self.killed_attempts |= live | await self._live_attempts(victim)
            return f"SIGKILL {victim} ({len(live)} attempts live), replaced by {slot.name}"
        if kind == "sigterm":
            slot = await self._busy_slot()
            live = await self._live_attempts(slot.name)
            self.stopped_attempts |= live
            name, proc = self.fleet.sigterm(slot)
            self._later(asyncio.to_thread(self.fleet.reap_stopped, name, proc))
            return f"SIGTERM {name} ({len(live)} attempts live), replaced by {slot.name}"
        if kind == "redis_restart":
            kill = self.rng.random() < 0.5
            await asyncio.to_thread(self.server.restart, kill=kill)
            return f"redis-server restarted ({'SIGKILL' if kill else 'SIGTERM'})"
        if kind == "weight_update":
            return f"weights v{await self.weights.publish_next()} published mid-step"
        if kind == "clock_step":
            return self._clock_step()
        if kind == "oom":
            return await self._oom()
        if kind == "slow_link":
            return self._slow_link()
        raise ValueError(f"unknown fault {kind!r}")

    async def _live_attempts(self, worker: str) -> set[tuple[str, int]]:
        """(rollout, attempt) of every attempt of ``worker`` live now: what a kill of it
        loses for real (a ``worker_lost`` of any other attempt of it is a false one)."""
        leases = Leases(self.admin)
        rids = await retrying("fault lookup", lambda: leases.held_by(worker), self.counts)
        store = EventStore(self.admin)
        live = set()
        for rid in rids:
            try:
                s = await retrying("fault lookup", lambda r=rid: store.head(r), self.counts)
            except Exception:
                continue  # acknowledged meanwhile, or unreadable (the audit names it)
            if s.status in LIVE and s.worker_id == worker:
                live.add((rid, s.attempt))
        return live

    async def _busy_slot(self) -> Slot:
        """A slot whose worker holds leases (a kill mid-generation), else any."""
        leases = Leases(self.admin)
        slots = list(self.fleet.slots)
        self.rng.shuffle(slots)
        for slot in slots:
            if await retrying("fault lookup", lambda s=slot: leases.held_by(s.name), self.counts):
                return slot
        return slots[0]

    def _clock_step(self) -> str:
        if self.clock_file is None:
            raise RuntimeError("no clock worker (libfaketime missing?)")
        offset = self.rng.choice(CLOCK_STEPS_S)
        hold = self.rng.uniform(*CLOCK_HOLD_S)
        write_clock(self.clock_file, offset)

        async def back() -> None:
            await asyncio.sleep(hold)
            write_clock(self.clock_file, 0)  # type: ignore[arg-type]

        self._spell("clock_step", back())
        name = next(s.name for s in self.fleet.slots if s.role == "clock")
        return f"clock of {name} stepped {offset:+d} s for {hold:.0f} s"

    async def _oom(self) -> str:
        info = await self.admin.info("memory")
        limit = int(info["used_memory"]) + OOM_MARGIN_BYTES
        await self.admin.config_set("maxmemory", limit)
        hold = self.rng.uniform(*OOM_HOLD_S)

        async def lift() -> None:
            await asyncio.sleep(hold)
            await retrying(
                "lift maxmemory", lambda: self.admin.config_set("maxmemory", 0), self.counts
            )

        self._spell("oom", lift())
        return f"Redis maxmemory {limit} (used + {OOM_MARGIN_BYTES // 1024} KB) for {hold:.1f} s"

    def _slow_link(self) -> str:
        if self.proxy is None:
            raise RuntimeError("no link proxy")
        proxy = self.proxy
        proxy.set_mode(LINK_SLOW)
        hold = self.rng.uniform(*LINK_HOLD_S)

        async def clean() -> None:
            await asyncio.sleep(hold)
            proxy.set_mode(CLEAN)

        self._spell("slow_link", clean())
        name = next(s.name for s in self.fleet.slots if s.role == "link")
        return f"link of {name} slow and dropping for {hold:.0f} s"

    def _spell(self, kind: str, ending: object) -> None:
        """A fault that lasts: a newer spell of the same kind replaces the older one's end."""
        old = self._spells.pop(kind, None)
        if old is not None:
            old.cancel()
        self._spells[kind] = asyncio.ensure_future(ending)  # type: ignore[arg-type]

    def _later(self, aw: object) -> None:
        task = asyncio.ensure_future(aw)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def restore(self) -> None:
        """End every spell now (clock back, link clean, memory unlimited) and wait for the
        SIGTERMed workers to exit (bounded: ``Fleet.reap_stopped``)."""
        for task in self._spells.values():
            task.cancel()
        self._spells.clear()
        if self.clock_file is not None:
            write_clock(self.clock_file, 0)
        if self.proxy is not None:
            self.proxy.set_mode(CLEAN)
        await retrying("lift maxmemory", lambda: self.admin.config_set("maxmemory", 0), self.counts)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
