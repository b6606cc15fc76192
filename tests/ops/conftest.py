"""Fixtures of the operator-command tests: as the worker tests, a redis-server of their own
(the scenarios run worker processes), and no idle vLLM engine polling beside them."""

from __future__ import annotations

from tests.workers.conftest import _no_idle_vllm_engines, server

__all__ = ["_no_idle_vllm_engines", "server"]
