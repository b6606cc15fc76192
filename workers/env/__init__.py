"""``rollouts env``: an environment runner serving registered Python tools for episodes.

A tool is a callable taking one ``Call`` and returning the observation token ids (a list of
ints) or a ``ToolOutput``; it raises ``ToolFatal`` for a call that can never succeed (any
other exception is an ``env_error``, retried within the episode's budget). ``tools.py`` holds
what a tool sees and returns, ``runner.py`` the loop that claims, runs and reports calls,
``upkeep.py`` its heartbeat and lost-call sweep, ``cli.py`` the command line.
"""

from __future__ import annotations

from workers.env.tools import Call, Tool, ToolFatal, ToolOutput

__all__ = ["Call", "Tool", "ToolFatal", "ToolOutput"]
