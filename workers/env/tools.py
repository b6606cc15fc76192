"""What a tool served by ``rollouts env`` sees (``Call``) and returns (``ToolOutput``, or the
bare observation token ids), how it says a call can never succeed (``ToolFatal``), and how
``--tools module:attr`` names the tools a runner serves (``load_tools``)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from statemachine.episode import ToolEffect
from store.environment import ToolCallClaim
from workers.errors import WorkerError


class ToolFatal(WorkerError):
    """Raised by a tool for a call that will never succeed (bad arguments, a broken task):
    the runner records ``env_fatal`` and the episode ends. Any other exception is recorded as
    ``env_error``, which the episode retries within its budget."""


class ToolLoadError(WorkerError):
    """A ``--tools`` entry that names no tool: a configuration error (exit code 2)."""

    exit_code = 2


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A call's result: the tokens the engine is fed before the next turn (the tool's output
    with the chat template's tokens around it) and the environment's state after the call
    (``env_handle``/``env_revision``: what a later ``restore`` goes back to)."""

    observation_token_ids: Sequence[int] | np.ndarray
    env_handle: str = ""
    env_revision: str = ""


@dataclass(frozen=True, slots=True)
class Call:
    """The call a tool runs, as its runner claimed it. ``restore``: an earlier run of this
    call was lost with its effect unverified and the tool declares ``restore``, so the
    environment must go back to ``env_revision`` (the last recorded result's) before running
    it. ``idempotency_key`` is the same for every run of the call: a tool with effects outside
    its sandbox passes it on, so that a second run is recognised there."""

    claim: ToolCallClaim

    @property
    def name(self) -> str:
        return self.claim.name

    @property
    def arguments(self) -> str:
        """The call's arguments as the episode recorded them (JSON text)."""
        return self.claim.arguments

    @property
    def args(self) -> Any:
        """``arguments`` parsed; ``ToolFatal`` if they are not JSON (no rerun fixes that)."""
        try:
            return json.loads(self.claim.arguments)
        except ValueError as exc:
            raise ToolFatal(f"arguments of {self.name!r} are not JSON: {exc}") from None

    @property
    def idempotency_key(self) -> str:
        return self.claim.idempotency_key

    @property
    def restore(self) -> bool:
        return self.claim.restore

    @property
    def env_handle(self) -> str:
        return self.claim.env_handle

    @property
    def env_revision(self) -> str:
        return self.claim.env_revision

    @property
    def effect(self) -> ToolEffect:
        return self.claim.effect

    @property
    def rollout_id(self) -> str:
        return self.claim.rollout_id

    @property
    def call_id(self) -> str:
        return self.claim.call_id


# A tool: sync (run in a thread of its own) or async (awaited on the runner's loop), returning
# what ``output_of`` accepts.
Tool = Callable[[Call], Any]


def output_of(name: str, returned: Any) -> ToolOutput:
    """What tool ``name`` returned, as a ``ToolOutput``: a ``ToolOutput``, a sequence or array
    of token ids, or any object with an ``observation_token_ids`` attribute (a dataclass of
    the tool's own). Anything else is a bug of the tool no rerun fixes: ``ToolFatal``. The
    ids themselves are checked by the domain when the result is recorded."""
    if isinstance(returned, ToolOutput):
        return returned
    if isinstance(returned, list | tuple | np.ndarray):
        return ToolOutput(returned)
    if hasattr(returned, "observation_token_ids"):
        return ToolOutput(
            returned.observation_token_ids,
            getattr(returned, "env_handle", ""),
            getattr(returned, "env_revision", ""),
        )
    raise ToolFatal(
        f"tool {name!r} returned {type(returned).__name__}: expected a list of observation "
        "token ids or a ToolOutput"
    )


def is_async(tool: Tool) -> bool:
    """Whether ``tool`` is awaited on the loop (a coroutine function, or an object whose
    ``__call__`` is one) rather than run in a thread."""
    return inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(
        getattr(tool, "__call__", None)  # noqa: B004  (the method, not whether it is callable)
    )


def load_tools(specs: Sequence[str], search: str | None = None) -> dict[str, Tool]:
    """The tools ``specs`` name, by name. Each spec is ``module:attr`` where ``attr`` (dotted
    for an attribute of an attribute) is a callable, registered under its ``__name__``, or a
    mapping name -> callable. ``search`` (default: the working directory) goes first on
    ``sys.path``, so that a module next to where the runner starts is found even when it runs
    as the installed ``rollouts`` script (as uvicorn and gunicorn do with their apps)."""
    path = os.getcwd() if search is None else search
    if path not in sys.path:
        sys.path.insert(0, path)
    tools: dict[str, Tool] = {}
    for spec in specs:
        for name, tool in _named(spec, _resolve(spec)).items():
            if name in tools and tools[name] is not tool:
                # A call names its tool: two of one name would make which one runs an accident.
                raise ToolLoadError(f"--tools {spec}: a tool named {name!r} is already loaded")
            tools[name] = tool
    if not tools:
        raise ToolLoadError("no tools: give --tools module:attr at least once")
    return tools


def _resolve(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ToolLoadError(f"--tools wants module:attr (e.g. examples.calculator:calculator), "
                            f"got {spec!r}")  # fmt: skip
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolLoadError(f"--tools {spec}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ToolLoadError(f"--tools {spec}: {module_name} has no {attr!r}") from None
    return obj


def _named(spec: str, obj: Any) -> dict[str, Tool]:
    if isinstance(obj, Mapping):
        for name, tool in obj.items():
            if not isinstance(name, str) or not name:
                raise ToolLoadError(f"--tools {spec}: tool names must be non-empty strings, "
                                    f"got {name!r}")  # fmt: skip
            if not callable(tool):
                raise ToolLoadError(f"--tools {spec}: {name!r} is not callable: {tool!r}")
        return dict(obj)
    if not callable(obj):
        raise ToolLoadError(f"--tools {spec}: neither a callable nor a mapping of them: "
                            f"{type(obj).__name__}")  # fmt: skip
    name = getattr(obj, "__name__", None)
    if not isinstance(name, str) or not name:
        raise ToolLoadError(f"--tools {spec}: {obj!r} has no __name__ to register it under; "
                            "export a mapping name -> callable instead")  # fmt: skip
    return {name: obj}
