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
# Room for every engine the in-process tests reuse: per model (dense, MoE) the base and the
# new-weights reference, plus the copy with another eos that one contract test uses. With
# room for 3, the MoE contract case evicted the dense engines, and test_vllm_local started
# them again (2 starts, 31 s). Each holds ~1.4 GB of RSS (engine core + worker process) and
# idles at a few % of a core; the workers package stops them all (tests/workers/conftest.py).
CAPACITY = 5


def vllm_pool(options: VllmOptions = TEST_OPTIONS, capacity: int = CAPACITY) -> EnginePool:
    return EnginePool(lambda d, v: VllmEngine(d, weight_version=v, options=options), capacity)
