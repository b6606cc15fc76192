"""Engines behind one protocol (`base.Engine`), by family: the CPU engine (`cpu/`), vLLM in
this process or over HTTP (`vllm/`), and a model-free `synthetic` engine. What the real
engines share is written once in `inflight.py`; their errors are in `errors.py`."""

from __future__ import annotations

from workers.engines.base import Chunk, Engine, EngineLimits, EngineRequest, expert_dtype

__all__ = ["Chunk", "Engine", "EngineLimits", "EngineRequest", "expert_dtype"]
