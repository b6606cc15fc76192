"""Engines behind one protocol: the CPU engine today, vLLM (in-process and over HTTP) later."""

from __future__ import annotations

from workers.engines.base import Chunk, Engine, EngineRequest, expert_dtype

__all__ = ["Chunk", "Engine", "EngineRequest", "expert_dtype"]
