"""A worker process that SIGKILLs itself at one step of taking a job (issue 17's windows).

``python -m tests.workers.dying_worker URL STEP``; STEP is where it dies:
- ``dequeued``: the job has left the queue (rq's intermediate list), nothing else happened;
- ``started``: rq lists the job as started by this worker; no lease, no event;
- ``leased``: the rollout's lease is taken, and its attempt opened in the same transaction
  (``Leases.take_steps``), no token yet;
- ``aborted``: an attempt ended (an engine error on the poison token 7), its lease dropped,
  and the worker dies before giving the job back.
It runs the real worker, with rq's execution TTL at 2 s so the test need not wait 15 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from workers.engines.synthetic import SyntheticEngine
from workers.rq_bridge import RqBridge
from workers.runner import RolloutRunner
from workers.worker import Worker, WorkerConfig


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(cls: Any, name: str, *, sync: bool = False) -> None:
    original = getattr(cls, name)
    if sync:

        def dying(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if result:  # something was taken
                _die()
            return result

        setattr(cls, name, dying)
        return

    async def dying_async(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        _die()
        return result

    setattr(cls, name, dying_async)


def _before(cls: Any, name: str) -> None:
    async def dying(*args: Any, **kwargs: Any) -> Any:
        _die()

    setattr(cls, name, dying)


def main(url: str, step: str) -> None:
    if step == "dequeued":
        _after(RqBridge, "_take", sync=True)  # on the dequeue thread: LMOVE and fetch only
    elif step == "started":
        _after(RqBridge, "_start", sync=True)  # on the books thread, once rq has it
    elif step == "leased":
        _after(RolloutRunner, "_begin")  # its lease goes with the attempt's opening
    elif step == "aborted":
        _before(RqBridge, "requeue")
    else:
        raise SystemExit(f"unknown step {step!r}")
    config = WorkerConfig(
        redis_url=url, name=f"dying-{step}", rq_execution_ttl_s=2.0, lease_ttl_s=2.0,
        heartbeat_s=0.25,
    )  # fmt: skip
    asyncio.run(Worker(config, SyntheticEngine(poison_token=7, tokens_per_chunk=1)).run())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
