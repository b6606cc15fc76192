"""The documentation stays true: docs/configuration.md, the configuration reference the README
links to, names every flag of every command and every environment variable the code reads."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from workers.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "configuration.md").read_text()
# One section per command, headed "## `rollouts NAME`"; the environment variables come last.
COMMANDS_PART = REFERENCE.split("\n## Environment variables", 1)[0]


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_of_every_command_is_in_the_reference() -> None:
    sections = re.split(r"^## `rollouts ([a-z-]+)`$", COMMANDS_PART, flags=re.MULTILINE)
    by_command = dict(zip(sections[1::2], sections[2::2], strict=True))
    missing = []
    for name, parser in _commands().items():
        text = by_command.get(name)
        if text is None:
            missing.append(f"rollouts {name}: no section")
            continue
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in {"-h", "--help", "--debug"}:
                    continue
                if f"`{flag}" not in text:
                    missing.append(f"rollouts {name} {flag}")
    assert not missing, missing


def test_every_environment_variable_the_code_reads_is_in_the_reference() -> None:
    names: set[str] = set()
    for package in ("store", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"ROLLOUTS_[A-Z_]*[A-Z]", path.read_text()))
    assert names, "found no environment variables: the scan is broken"
    missing = sorted(n for n in names if f"`{n}`" not in REFERENCE)
    assert not missing, missing
