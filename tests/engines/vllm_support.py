"""Shared in-process vLLM engines for the tests, and the options the tests start them with.

Starting an AsyncLLM costs 15-40 s of CPU on this 2-core machine (two spawned processes that
import vLLM), so engines are pooled per model directory for the whole session
(`tests.engine_pool`). All users must share one event loop (AsyncLLM binds its output task to
the loop that first uses it): the vLLM tests run on pytest-asyncio's session loop.
"""

from __future__ import annotations

from tests.engine_pool import EnginePool
from workers.engines.vllm.local import VllmEngine, VllmOptions

# Small on purpose: the tests' sequences are short, and KV space and startup scale with it.
# One token per chunk (also the default), pinned here: the contract suite's in-flight tests
# take a few chunks of a 24-token request before acting, which 16-token chunks would finish.
TEST_OPTIONS = VllmOptions(max_model_len=512, kv_cache_bytes=64 << 20, stream_interval=1)
# One test group needs at most three live engines (base model, new-weights reference, a
# copy with another eos); more would hold ~1 GB each for nothing.
CAPACITY = 3


def vllm_pool(options: VllmOptions = TEST_OPTIONS, capacity: int = CAPACITY) -> EnginePool:
    return EnginePool(lambda d, v: VllmEngine(d, weight_version=v, options=options), capacity)
