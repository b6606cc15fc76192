"""A worker's lease heartbeat in a process of its own, timing how long Redis keeps it waiting.

``python -m tests.store.renewals URL``: takes a lease, then renews it (``Leases.renew``, the
worker's one-command heartbeat) every ``EVERY_S`` on its own connection until its stdin closes,
and prints ``{"renewals": n, "max_gap_s": g}``: the longest time between two answered renewals.
A process of its own so that the gaps are Redis' (a script or transaction holding it), not the
test's event loop busy building a bulk operation's commands.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import redis.asyncio as aredis

from store.leases import Leases

EVERY_S = 0.005
ROLLOUT = "lease-watch"


async def watch(url: str, stopped: threading.Event) -> dict[str, float]:
    client = aredis.Redis.from_url(url)
    leases = Leases(client, holder="watcher")
    await leases.take(ROLLOUT, 60.0)
    print("ready", flush=True)
    renewals, worst = 0, 0.0
    last = time.monotonic()
    while not stopped.is_set():
        await leases.renew([ROLLOUT], 60.0)
        now = time.monotonic()
        worst = max(worst, now - last)
        renewals += 1
        last = now
        await asyncio.sleep(EVERY_S)
    await leases.drop(ROLLOUT)
    await client.aclose()
    return {"renewals": renewals, "max_gap_s": worst}


def main() -> None:
    stopped = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stopped.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print(json.dumps(asyncio.run(watch(sys.argv[1], stopped))), flush=True)


if __name__ == "__main__":
    main()
