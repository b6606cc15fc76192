"""What `--tools module:attr` loads, what a tool may return, the calculator example on its
own, and `rollouts env`'s refusals (one line, exit code 2, nothing started)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from examples import calculator as calc
from statemachine.episode import ToolEffect
from store.environment import ToolCallClaim
from workers.cli import main
from workers.env import Call, ToolFatal, ToolOutput
from workers.env.tools import ToolLoadError, is_async, load_tools, output_of


def call(arguments: str = '{"token_ids": [1, 2]}', revision: str = "", **kw: Any) -> Call:
    fields: dict[str, Any] = {
        "rollout_id": "ep", "call_id": "c1", "claim": 1, "runner_id": "r", "name": "calculator",
        "arguments": arguments, "idempotency_key": "ep/c1", "effect": ToolEffect.IDEMPOTENT,
        "env_handle": "", "env_revision": revision, "restore": False,
    }  # fmt: skip
    return Call(ToolCallClaim(**{**fields, **kw}))


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A module of tools, ``envtools_test``, importable for the test."""
    mod = ModuleType("envtools_test")

    def add(c: Call) -> list[int]:
        return [1]

    async def fetch(c: Call) -> list[int]:
        return [2]

    mod.add = add  # type: ignore[attr-defined]
    mod.TOOLS = {"sum": add, "fetch": fetch}  # type: ignore[attr-defined]
    mod.box = type("Box", (), {"inner": staticmethod(add)})  # type: ignore[attr-defined]
    mod.number = 3  # type: ignore[attr-defined]
    mod.BAD = {"x": 3}  # type: ignore[attr-defined]
    mod.unnamed = type("Callable", (), {"__call__": lambda self, c: [1]})()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "envtools_test", mod)
    return mod


def test_a_callable_is_served_under_its_name_and_a_mapping_under_its_keys(
    module: ModuleType,
) -> None:
    tools = load_tools(["envtools_test:add", "envtools_test:TOOLS", "envtools_test:box.inner"])
    assert tools == {"add": module.add, "sum": module.add, "fetch": module.TOOLS["fetch"]}
    assert not is_async(tools["add"]) and is_async(tools["fetch"])


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("envtools_test", "wants module:attr"),
        ("no_such_module_here:x", "cannot import 'no_such_module_here'"),
        ("envtools_test:missing", "has no 'missing'"),
        ("envtools_test:number", "neither a callable nor a mapping"),
        ("envtools_test:BAD", "'x' is not callable"),
        ("envtools_test:unnamed", "has no __name__"),
    ],
)
def test_a_spec_naming_no_tool_is_refused(module: ModuleType, spec: str, error: str) -> None:
    with pytest.raises(ToolLoadError, match=error):
        load_tools([spec])


def test_two_tools_of_one_name_are_refused(module: ModuleType) -> None:
    module.other = {"add": module.TOOLS["fetch"]}  # type: ignore[attr-defined]
    with pytest.raises(ToolLoadError, match="'add' is already loaded"):
        load_tools(["envtools_test:add", "envtools_test:other"])


def test_the_working_directory_is_searched_first(tmp_path: Path) -> None:
    (tmp_path / "envtools_cwd.py").write_text("def ping(call):\n    return [1]\n")
    try:
        assert list(load_tools(["envtools_cwd:ping"], search=str(tmp_path))) == ["ping"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("envtools_cwd", None)


def test_what_a_tool_may_return() -> None:
    assert output_of("t", [1, 2]) == ToolOutput([1, 2])
    out = output_of("t", np.array([3], dtype=np.int64))
    assert list(out.observation_token_ids) == [3]
    full = ToolOutput([1], env_handle="h", env_revision="v")
    assert output_of("t", full) is full

    class Own:  # a dataclass of the tool's own, duck-typed
        observation_token_ids = (4,)
        env_revision = "v2"

    assert output_of("t", Own()) == ToolOutput((4,), "", "v2")
    with pytest.raises(ToolFatal, match="returned dict"):
        output_of("t", {"ids": [1]})


def test_the_calculator_answers_from_the_tokens_only() -> None:
    out = calc.calculator(call('{"token_ids": [1200, 34]}', revision="rev-2"))
    assert out == ToolOutput([11, 12, 13, 14], env_handle="calculator", env_revision="rev-3")
    assert calc.calculator(call()).env_revision == "rev-1"
    for bad in ('{"token_ids": [1.5]}', '{"token_ids": 3}', "[1, 2]", "{"):
        with pytest.raises(ToolFatal):
            calc.calculator(call(bad))
    with pytest.raises(ToolFatal, match="not a calculator revision"):
        calc.calculator(call(revision="v7"))


def test_the_calculators_episode_declares_it() -> None:
    assert [t.name for t in calc.TOOLS] == ["calculator"]
    spec = calc.episode_spec([7], effect="restore", max_turns=3)
    assert spec.effect_of("calculator") is ToolEffect.RESTORE and spec.max_turns == 3


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--tools", "nope_module:x"], "cannot import 'nope_module'"),
        (["--tools", "examples.calculator:calculator", "--concurrency", "0"], "above 0"),
        (["--tools", "examples.calculator:calculator", "--queue", "a:b"], "a queue name"),
        (["--tools", "examples.calculator:calculator", "--lease-s", "nan"], "above 0"),
    ],
)
def test_rollouts_env_refuses_a_bad_configuration_in_one_line(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1: nothing listens there, and nothing is reached before the refusal.
    try:
        code = main(["env", "--redis", "redis://127.0.0.1:1/0", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and error in err and "Traceback" not in err, err
