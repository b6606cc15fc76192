"""How a worker follows the deployment's pause (a harness's ``POST /pause?mode=``, SkyRL's and
vLLM's control plane; the record is ``store.pause``).

The heartbeat reads the flag in the round trip of its stats beat (``store.stats.beat``), so a
``/pause`` or ``/resume`` reaches every worker within one ``heartbeat_s`` (1 s by default) for
no extra round trip, and a worker that missed a notice (Redis restarted, a beat lost) simply
reads the flag again on its next beat: nothing to resubscribe. A worker also reads it once
before its first job (``Worker.run``).

While paused the worker takes no job, as while Redis refuses writes: jobs stay queued, no
rollout is opened, nothing is charged. A job dequeued just before the worker saw the pause is
given back to the front of its queue without being opened (``Worker._run_job``). By mode:

- ``keep`` and ``wait``: rollouts already running go on to their end. (vLLM's ``keep`` freezes
  its requests in the engine instead; a frozen rollout would hold its worker's slot and KV
  cache, and a harness that wants nothing generated during a pause has ``abort``, which here
  loses nothing.) ``wait`` differs only in when ``/pause`` answers: once no rollout runs on any
  worker (``store/api/harness/control.py``).
- ``abort``: every running rollout is aborted at once, its progress kept, with its own reason
  (``AbortReason.PAUSED``), exactly as a weight update gives rollouts back
  (``workers.weight_updates``): its job goes back to the front of the queue
  (``JobEndings.settle``), no retry budget is charged, and after ``/resume`` it resumes from
  its saved tokens.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from statemachine import AbortReason
from store.logs import log_event
from store.pause import Pause
from workers.gates import until_open

log = logging.getLogger("rollouts.worker")


class Stoppable(Protocol):
    """What a pause stops (``workers.runner.RolloutRunner``)."""

    @property
    def active(self) -> list[str]: ...

    async def stop(self, rollout_id: str, reason: AbortReason, detail: str = "") -> None: ...


class DeploymentPause:
    """The deployment's pause as one worker follows it: whether it admits rollouts now."""

    def __init__(self, worker: str = "") -> None:
        self.worker = worker  # for its log lines
        self.current: Pause | None = None
        self.admitting = asyncio.Event()  # set while no pause holds: the worker takes jobs
        self.admitting.set()
        self.aborted = 0  # rollouts this worker aborted for pauses (mode abort)
        self._stops: set[asyncio.Task[None]] = set()

    @property
    def holds(self) -> bool:
        return self.current is not None

    @property
    def since(self) -> float | None:
        """The ``at`` of the pause held (what the stats beat reports), None while admitting."""
        return None if self.current is None else self.current.at

    def follow(self, now: Pause | None, runner: Stoppable) -> None:
        """The flag as just read: start or lift a pause, and for mode ``abort`` stop every
        running rollout. The stops run as tasks of their own: the heartbeat that read the flag
        must not wait on an engine's aborts (its leases are renewed on time)."""
        before = self.current
        if now == before:
            return
        self.current = now
        if now is None:
            self.admitting.set()
            assert before is not None
            log_event(
                log, logging.INFO, "resumed",
                f"deployment resumed after {before.mode} pause: taking jobs again",
                worker=self.worker, mode=before.mode,
            )  # fmt: skip
            return
        self.admitting.clear()
        running = runner.active
        log_event(
            log, logging.INFO, "paused",
            f"deployment paused (mode {now.mode}): taking no new job"
            + (f", aborting {len(running)} running rollouts with their progress kept"
               if now.mode == "abort" else f", {len(running)} running rollouts go on"),
            worker=self.worker, mode=now.mode, running=len(running),
        )  # fmt: skip
        if now.mode == "abort":
            task = asyncio.create_task(self._abort(runner, running, now), name="pause abort")
            self._stops.add(task)
            task.add_done_callback(self._stops.discard)

    async def _abort(self, runner: Stoppable, running: list[str], pause: Pause) -> None:
        detail = f"deployment paused (mode=abort) at {pause.at:.3f}"
        for rid in running:
            await runner.stop(rid, AbortReason.PAUSED, detail)
            self.aborted += 1

    async def wait_admitting(self, stop: asyncio.Event) -> bool:
        """Until no pause holds (True) or ``stop`` is set (False)."""
        return await until_open(self.admitting, stop)
