"""Per-item backoff (workers/backoff.py): a failing item waits, doubling up to the cap, and
never holds up the others."""

from __future__ import annotations

import pytest

from workers import backoff as backoff_module
from workers.backoff import Backoff


def test_each_failure_doubles_the_wait_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(backoff_module.time, "monotonic", lambda: clock[0])
    b = Backoff(1.0, 5.0)
    assert b.due("a") and len(b) == 0
    assert [b.failed("a") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert not b.due("a") and b.due("b")  # another item is not held up
    clock[0] += 4.9
    assert not b.due("a")
    clock[0] += 0.1
    assert b.due("a")
    b.done("a")
    assert b.failed("a") == 1.0  # a success starts it over


def test_items_no_longer_there_are_forgotten() -> None:
    b = Backoff(1.0, 5.0)
    for item in ("a", "b", "c"):
        b.failed(item)
    b.keep_only(["b", "z"])
    assert len(b) == 1 and not b.due("b") and b.due("a") and b.due("c")
