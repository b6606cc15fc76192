"""Errors raised by the worker package: one base, so callers can catch the whole family.

The engines' errors (`EngineError` and its subclasses) live in `workers.engines.errors` and
derive from `WorkerError` too.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error raised by `workers`."""
