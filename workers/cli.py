"""The `rollouts` command line: one function per subcommand, registered in `COMMANDS`.

Adding a subcommand means writing `_add_NAME(subparsers)` and `_run_NAME(args) -> int` and
listing them in `COMMANDS`; heavy imports (torch, transformers) stay inside the run
functions so `rollouts --help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_make_tiny_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the model into (created if missing)")
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE (8 experts, top-2)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    # Lazy: torch and transformers take seconds to import; `rollouts --help` should not.
    from workers.tiny_model import make_tiny_model  # noqa: PLC0415

    path = make_tiny_model(args.dir, moe=args.moe, seed=args.seed)
    print(path)
    return 0


def _configure_worker(parser: argparse.ArgumentParser) -> None:
    from workers import worker_cli  # noqa: PLC0415

    worker_cli.configure(parser)


def _run_worker(args: argparse.Namespace) -> int:
    from workers import worker_cli  # noqa: PLC0415

    return worker_cli.run(args)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    from workers import demo  # noqa: PLC0415

    demo.configure(parser)


def _run_demo(args: argparse.Namespace) -> int:
    from workers import demo  # noqa: PLC0415

    return demo.run(args)


COMMANDS: tuple[Command, ...] = (
    Command(
        name="demo",
        help="end-to-end demo on a tiny local model: stop a worker mid-run, lose nothing",
        configure=_configure_demo,
        run=_run_demo,
    ),
    Command(
        name="worker",
        help="run a worker: a resident engine generating up to N rollouts at once from rq",
        configure=_configure_worker,
        run=_run_worker,
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
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
