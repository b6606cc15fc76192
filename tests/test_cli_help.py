"""Every flag of every `rollouts` command says what it does and shows its default.

An operator reads `rollouts CMD --help`, not the source: a flag without help, or with a default
the help does not show, is a question they cannot answer. The walk covers every subcommand that
``workers.cli.build_parser`` registers, so a new one is checked without a change here.
"""

from __future__ import annotations

import argparse

import pytest

from workers.cli import COMMANDS, build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [group] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(group.choices)


def _problems(parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = action.help
        if not text or text == argparse.SUPPRESS:
            problems.append(f"{name}: no help text")
            continue
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            continue
        if "%(default)" in text or any(form in text for form in _forms(default)):
            continue
        problems.append(f"{name}: help does not show its default {default!r}: {text!r}")
    return problems


def _forms(default: object) -> list[str]:
    """How a help text may spell a default: as it prints, and a whole float without ".0"."""
    forms = [str(default), repr(default)]
    if isinstance(default, float):
        forms.append(f"{default:g}")
    if isinstance(default, list | tuple):
        forms.append(", ".join(map(str, default)))
    return forms


def test_every_command_is_walked() -> None:
    assert set(_subparsers(build_parser())) == {c.name for c in COMMANDS}


def test_the_top_level_flags() -> None:
    assert _problems(build_parser()) == []


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_flag_has_help_showing_its_default(command: str) -> None:
    assert _problems(_subparsers(build_parser())[command]) == []


def test_the_check_catches_what_it_should() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--silent", type=int)
    parser.add_argument("--hidden", type=int, default=7, help="how many (a number)")
    parser.add_argument("--shown", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--switch", action="store_true", help="a switch")
    assert _problems(parser) == [
        "--silent: no help text",
        "--hidden: help does not show its default 7: 'how many (a number)'",
    ]
