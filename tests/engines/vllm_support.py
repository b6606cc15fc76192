"""Shared in-process vLLM engines for the tests, and the options the tests start them with.

Starting an AsyncLLM costs 15-40 s of CPU on this 2-core machine (two spawned processes that
import vLLM), so engines are pooled per model directory for the whole session instead of per
test. A test that gets a pooled engine gets it idle, at the weight version it asked for and on
the weights of the directory it named (reloaded in place if an earlier test swapped them).
All users must share one event loop (AsyncLLM binds its output task to the loop that first
uses it): the vLLM tests run on pytest-asyncio's session loop.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from workers.engines.vllm_local import VllmEngine, VllmOptions

# Small on purpose: the tests' sequences are short, and KV space and startup scale with it.
# One token per chunk (also the default), pinned here: the contract suite's in-flight tests
# take a few chunks of a 24-token request before acting, which 16-token chunks would finish.
TEST_OPTIONS = VllmOptions(max_model_len=512, kv_cache_bytes=64 << 20, stream_interval=1)
# One test group needs at most three live engines (base model, new-weights reference, a
# copy with another eos); more would hold ~1 GB each for nothing.
CAPACITY = 3


class VllmPool:
    def __init__(self, options: VllmOptions = TEST_OPTIONS, capacity: int = CAPACITY) -> None:
        self.options = options
        self.capacity = capacity
        self._engines: OrderedDict[str, VllmEngine] = OrderedDict()
        self.started = 0

    async def get(self, model_dir: Path, weight_version: int = 0) -> VllmEngine:
        key = str(model_dir)
        engine = self._engines.pop(key, None)
        if engine is None:
            while len(self._engines) >= self.capacity:
                _, old = self._engines.popitem(last=False)
                await old.close()
            # The constructor blocks for seconds; a thread keeps the loop (and timeouts) alive.
            engine = await asyncio.to_thread(
                VllmEngine, model_dir, weight_version=weight_version, options=self.options
            )
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
