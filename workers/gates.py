"""A worker's gates on taking jobs (the store writable, the deployment not paused): waiting
for one to open, or for the worker to stop, whichever comes first."""

from __future__ import annotations

import asyncio


async def until_open(gate: asyncio.Event, stop: asyncio.Event) -> bool:
    """Until ``gate`` is set (True) or ``stop`` is (False)."""
    if gate.is_set():
        return True
    opened = asyncio.ensure_future(gate.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({opened, stopping}, return_when=asyncio.FIRST_COMPLETED)
    opened.cancel()
    stopping.cancel()
    return gate.is_set()
