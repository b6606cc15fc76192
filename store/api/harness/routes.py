"""The harness endpoints, gathered: each module of this package that serves some lists them
in ``ROUTES`` (``Route`` with ``harness=True``) and serves them with ``Handlers(calls)``."""

from __future__ import annotations

from typing import Any

from ..route import Route
from . import control, generate, openai_api
from .call import Calls

MODULES: tuple[Any, ...] = (generate, openai_api, control)


def routes() -> tuple[Route, ...]:
    return tuple(r for m in MODULES for r in m.ROUTES)


def handlers(calls: Calls) -> dict[str, Any]:
    """Route name -> its handler."""
    out: dict[str, Any] = {}
    for m in MODULES:
        served = m.Handlers(calls)
        out.update({r.name: getattr(served, r.name) for r in m.ROUTES})
    return out
