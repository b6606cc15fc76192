"""The `rollouts` command line: one function per subcommand, registered in `COMMANDS`.

Adding a subcommand means writing `_add_NAME(subparsers)` and `_run_NAME(args) -> int` and
listing them in `COMMANDS`; heavy imports (torch, transformers) stay inside the run
functions so `rollouts --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from store.errors import InvalidRedisUrl, InvalidRolloutId


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_make_tiny_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the model into (created if missing)")
    parser.add_argument(
        "--moe", action="store_true", help="Qwen3-MoE (8 experts, top-2), not dense (a switch)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--tool-turn",
        type=int,
        default=0,
        metavar="K",
        help="the model says a fixed K-token turn ending at a tool-call token (id 1000+K-1) "
        "after any other token: episodes on it call a tool every K tokens (default 0: off)",
    )


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    # Lazy: torch and transformers take seconds to import; `rollouts --help` should not.
    from workers.demo.tiny_model import make_tiny_model  # noqa: PLC0415

    path = make_tiny_model(args.dir, moe=args.moe, seed=args.seed, tool_turn=args.tool_turn)
    print(path)
    return 0


def _lazy(
    module: str, configure: str, run: str
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """A subcommand whose module is imported only when it is used (or its --help shown)."""

    def _configure(parser: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(module), configure)(parser)

    def _run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), run)(args))

    return _configure, _run


def _command(name: str, help: str, module: str, suffix: str = "") -> Command:
    configure, run = _lazy(module, f"configure{suffix}", f"run{suffix}")
    return Command(name=name, help=help, configure=configure, run=run)


COMMANDS: tuple[Command, ...] = (
    _command(
        "demo",
        "end-to-end demo on a tiny local model: stop a worker mid-run, lose nothing",
        "workers.demo.run",
    ),
    _command(
        "worker",
        "run a worker: a resident engine generating up to N rollouts at once from rq",
        "workers.worker_cli",
    ),
    _command(
        "env",
        "run an environment runner: serve Python tools for episodes' tool calls",
        "workers.env.cli",
    ),
    _command(
        "api",
        "serve the trainer API over HTTP (JSON or msgpack), with /openapi.json and /metrics",
        "store.api.cli",
    ),
    _command(
        "status",
        "rollouts by state, queue depth, and every worker's load, weights and heartbeat",
        "workers.ops.commands",
        "_status",
    ),
    _command(
        "show",
        "one rollout's history as a timeline: attempts, aborts, weights",
        "workers.ops.commands",
        "_show",
    ),
    _command(
        "stuck",
        "rollouts that will not progress by themselves: no job, quarantined, lease expired",
        "workers.ops.commands",
        "_stuck",
    ),
    _command("cancel", "cancel rollouts by id or a whole batch", "workers.ops.commands", "_cancel"),
    _command(
        "requeue",
        "give a stuck or quarantined rollout, or every waiting one without a job, a job again "
        "(it resumes from its saved tokens)",
        "workers.ops.requeue",
    ),
    Command(
        name="make-tiny-model",
        help="write a tiny random-weight Qwen3 / Qwen3-MoE model directory (no download)",
        configure=_configure_make_tiny_model,
        run=_run_make_tiny_model,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollouts", description="durable-rollouts: durable, event-sourced LLM generation"
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        # Also after the command (`rollouts show X --debug`); SUPPRESS, or the subcommand's
        # default would overwrite a `rollouts --debug show X`.
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help=_DEBUG_HELP)  # fmt: skip
        sub.set_defaults(_run=command.run)
    return parser


_DEBUG_HELP = "on an error, print its traceback too, not only the one-line message (a switch)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Its error is one line on stderr (``rollouts CMD: error: ...``) and exit
    code 1, or 2 for a usage or configuration error; ``--debug`` adds the traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except Exception as exc:
        # Every failure of every command ends here: an operator reads one line, not a traceback.
        # A long-running process (worker, api, demo) that dies of something unforeseen keeps
        # its traceback in its log all the same: that is the bug report.
        if args.debug or (args.command in SERVICES and not _foreseen(exc)):
            traceback.print_exc()
        print(f"rollouts {args.command}: error: {_describe(exc)}", file=sys.stderr, flush=True)
        return _exit_code(exc)


def _describe(exc: Exception) -> str:
    if isinstance(exc, RedisError) and not isinstance(exc, ResponseError):
        # redis-py's message names host and port, never the URL or its password.
        return f"Redis: {exc}"
    return str(exc) or type(exc).__name__


# Commands that run until stopped, under a supervisor whose log is all there is after a crash.
SERVICES = frozenset({"worker", "env", "api", "demo"})


def _foreseen(exc: Exception) -> bool:
    """An error the message says all about: Redis unreachable, a bad URL or id, or one a
    command raised on purpose with its exit code."""
    return isinstance(exc, RedisError | InvalidRedisUrl | InvalidRolloutId) or isinstance(
        getattr(exc, "exit_code", None), int
    )


def _exit_code(exc: Exception) -> int:
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    # A URL or a rollout id that cannot be used: bad input, as argparse's own errors.
    return 2 if isinstance(exc, InvalidRedisUrl | InvalidRolloutId) else 1


if __name__ == "__main__":
    sys.exit(main())
