"""Build an engine by name, importing only what that engine needs."""

from __future__ import annotations

from workers.engines.base import Engine

ENGINES = ("cpu", "synthetic")


def make_engine(name: str, model: str | None, *, weight_version: int = 0) -> Engine:
    if name == "cpu":
        if not model:
            raise ValueError("--engine cpu needs --model DIR (see `rollouts make-tiny-model`)")
        from workers.engines.cpu import CpuEngine  # noqa: PLC0415  (torch: import on demand)

        return CpuEngine(model, weight_version=weight_version)
    if name == "synthetic":
        from workers.engines.synthetic import SyntheticEngine  # noqa: PLC0415

        return SyntheticEngine(weight_version=weight_version)
    raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
