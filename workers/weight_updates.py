"""How a worker follows published weight versions.

A task blocks on the weight log (``WeightRegistry.wait_newer``); when a newer version appears
the worker applies it according to the deployment's mode:

- ``abort`` (default): stop admitting, abort every in-flight generation at once, persist its
  partial tokens, logprobs and routes with ``aborted(weight_update)``, requeue it at the front,
  load the weights (the engine drops any KV/prefix cache computed with the old ones), admit
  again. Resumed rollouts re-prefill ``prompt + partial`` on the new weights.
- ``drain``: stop admitting, let in-flight rollouts finish on the old weights, then load.
- ``keep``: load while generations stay in flight; the engine switches at a safe point between
  steps and recomputes their KV on the new weights (vLLM: ``pause(mode="keep")``).

Whatever the mode, every token records the version that sampled it, so the switch is exact
in the log. A worker that starts, or falls behind, loads the newest version before admitting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from statemachine import AbortReason
from store.errors import unwritable
from store.logs import log_event
from store.weights import WeightRegistry, WeightVersion
from workers.engines.base import Engine
from workers.engines.errors import EngineDead, EngineError
from workers.runner import RolloutRunner

log = logging.getLogger("rollouts.weights")

# Longest blocking read of the weight log: a new version is seen at once anyway (XREAD
# returns when it is published); this only bounds how long a stop can go unnoticed.
FOLLOW_BLOCK_S = 2.0


class WeightMode(StrEnum):
    ABORT = "abort"
    DRAIN = "drain"
    KEEP = "keep"


@dataclass(frozen=True, slots=True)
class UpdateTiming:
    version: int
    published_at: float
    stopped_s: float  # abort + persist (abort mode) or draining (drain mode)
    load_s: float
    done_at: float


class Host(Protocol):
    """What the follower needs of its worker (``workers.worker.Worker``), named here so
    that this module does not import the worker, which imports it."""

    engine: Engine
    admitting: asyncio.Event
    runner: RolloutRunner

    @property
    def name(self) -> str: ...

    def engine_died(self, error: str) -> None: ...


class WeightFollower:
    def __init__(self, worker: Host, registry: WeightRegistry, mode: WeightMode) -> None:
        self.worker = worker
        self.registry = registry
        self.mode = mode
        self.updates: list[UpdateTiming] = []
        self.refused = -1  # the newest version the engine could not load

    async def catch_up(self) -> None:
        """Load the newest published version if the engine is behind (before admitting).

        A checkpoint the engine refuses is skipped as in ``follow``; raising here instead
        would make a supervised worker restart, fail the same way, and loop.
        """
        latest = await self.registry.latest()
        if latest is not None and latest.version > self.worker.engine.weight_version:
            await self._try(latest)

    async def follow(self, stop: asyncio.Event) -> None:
        """Apply each newer version until ``stop`` is set (checked after every blocking read,
        which lasts at most ``FOLLOW_BLOCK_S``: a lost cancel cannot keep this running)."""
        while not stop.is_set():
            seen = max(self.worker.engine.weight_version, self.refused)
            try:
                newer = await self.registry.wait_newer(seen, FOLLOW_BLOCK_S)
            except Exception as exc:
                # Redis unreachable beyond the client's retries (or refusing an idle
                # connection's health-check PING under MISCONF): keep following once it is back.
                log.warning("cannot read the weight log (%s); retrying", exc,
                            exc_info=unwritable(exc) is None)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), FOLLOW_BLOCK_S)
                continue
            if newer is None or stop.is_set():
                continue
            try:
                await self._try(newer)
            except EngineDead as exc:
                self.worker.engine_died(f"{type(exc).__name__}: {exc}")
                return

    async def _try(self, wv: WeightVersion) -> None:
        try:
            await self.apply(wv)
        except EngineDead:
            raise
        except EngineError as exc:
            # A bad checkpoint: the engine kept its weights. Serve on them (every token says
            # which) rather than stop; a newer publish is tried as usual.
            serving = self.worker.engine.weight_version
            log_event(
                log, logging.ERROR, "weight_refused",
                f"weights v{wv.version} refused, still serving v{serving}: {exc}",
                worker=self.worker.name, version=wv.version, serving=serving, error=str(exc),
            )  # fmt: skip
            self.refused = wv.version

    async def apply(self, wv: WeightVersion) -> None:
        worker = self.worker
        t0 = time.monotonic()
        old = worker.engine.weight_version
        log_event(
            log, logging.INFO, "weight_update",
            f"weights v{old} -> v{wv.version} ({self.mode} mode)",
            worker=worker.name, version=wv.version, from_version=old, mode=self.mode.value,
        )  # fmt: skip
        if self.mode is WeightMode.KEEP:
            stopped = t0
        else:
            worker.admitting.clear()
            if self.mode is WeightMode.ABORT:
                detail = f"mode=abort, v{worker.engine.weight_version} -> v{wv.version}"
                for rid in list(worker.runner.active):
                    await worker.runner.stop(rid, AbortReason.WEIGHT_UPDATE, detail)
            # Jobs dequeued meanwhile wait at the admission gate, outside the runner.
            await worker.runner.wait_idle()
            stopped = time.monotonic()
        try:
            await worker.engine.load_weights(wv.path, wv.version)
        finally:
            worker.admitting.set()
        done = time.monotonic()
        log_event(
            log, logging.INFO, "weight_load",
            f"weights v{wv.version} loaded in {done - stopped:.2f} s "
            f"({stopped - t0:.2f} s to stop in-flight generation first)",
            worker=worker.name, version=wv.version, from_version=old,
            seconds=round(done - stopped, 3), stopped_seconds=round(stopped - t0, 3),
        )  # fmt: skip
        self.updates.append(
            UpdateTiming(
                version=wv.version,
                published_at=wv.at,
                stopped_s=stopped - t0,
                load_s=done - stopped,
                done_at=time.time(),
            )
        )
