"""A live worker whose event loop stalls again and again (a CPU-bound step, a long GC pause).

``python -m tests.workers.slow_loop_worker URL NAME BLOCK_S``: the real worker on the paced
synthetic engine, plus a task that blocks the whole event loop for ``BLOCK_S`` seconds
(``time.sleep``: no heartbeat, no Redis read, no generation meanwhile) every 0.2 s of loop time.
Its lease TTL is the default (5 s) and its heartbeat 0.25 s, so its leases never lapse; its
Redis connections stay open throughout. SIGTERM stops it as the CLI does.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from tests.workers.helpers import SYNTHETIC_PACE
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig


async def _stall(block_s: float) -> None:
    while True:
        await asyncio.sleep(0.2)
        time.sleep(block_s)  # the point: the event loop does nothing else meanwhile


async def main(url: str, name: str, block_s: float) -> None:
    config = WorkerConfig(redis_url=url, name=name, max_concurrency=2, heartbeat_s=0.25)
    worker = Worker(config, SyntheticEngine(**SYNTHETIC_PACE))  # type: ignore[arg-type]
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.request_stop)
    stall = asyncio.create_task(_stall(block_s))
    try:
        await worker.run()
    finally:
        stall.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
