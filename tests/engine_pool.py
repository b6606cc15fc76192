"""Engines shared across tests, one per model directory, handed out idle and on the weights
asked for.

Starting an engine costs seconds (the CPU engine's core process imports torch and
transformers: 6-8 s here; an AsyncLLM 15-40 s), so tests that only need *an* engine on some
weights take one from a pool instead of starting their own. A test that gets a pooled engine
gets it with nothing in flight, at the weight version it asked for and on the weights of the
directory it named (reloaded in place if an earlier test swapped them). Tests that close,
kill or break an engine start their own.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EnginePool:
    def __init__(self, build: Callable[[Path, int], Any], capacity: int) -> None:
        self.build = build  # blocking constructor: (model_dir, weight_version) -> engine
        self.capacity = capacity
        self._engines: OrderedDict[str, Any] = OrderedDict()
        self.started = 0

    async def get(self, model_dir: Path, weight_version: int = 0) -> Any:
        key = str(model_dir)
        engine = self._engines.pop(key, None)
        if engine is None:
            while len(self._engines) >= self.capacity:
                _, old = self._engines.popitem(last=False)
                await old.close()
            # The constructor blocks for seconds; a thread keeps the loop (and timeouts) alive.
            engine = await asyncio.to_thread(self.build, model_dir, weight_version)
            self.started += 1
        else:
            for request_id in engine.in_flight:
                await engine.abort(request_id)  # whatever an earlier test left running
            if engine.source != key or engine.weight_version != weight_version:
                await engine.load_weights(key, weight_version)
        self._engines[key] = engine
        return engine

    async def close(self) -> None:
        while self._engines:
            _, engine = self._engines.popitem()
            await engine.close()


def cpu_pool(capacity: int = 4) -> EnginePool:
    from workers.engines.cpu.engine import CpuEngine

    return EnginePool(lambda d, v: CpuEngine(d, weight_version=v), capacity)
