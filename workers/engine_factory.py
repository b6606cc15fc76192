"""Build an engine by name, importing only what that engine needs.

Engine options that have no flag of their own come from the environment: vllm's engine
arguments (``$ROLLOUTS_VLLM_ENGINE_ARGS``), vllm-http's servers (``$ROLLOUTS_VLLM_SERVERS``)
and the synthetic engine's keyword arguments (``$ROLLOUTS_SYNTHETIC_ENGINE``, e.g. its pace).
"""

from __future__ import annotations

import json
import os

from workers.engines.base import Engine

ENGINES = ("cpu", "synthetic", "vllm", "vllm-http")

# vllm: extra AsyncEngineArgs as a JSON object, e.g. '{"max_model_len": 8192, "dtype":
# "bfloat16"}' (defaults: workers.engines.vllm.local.VllmOptions).
VLLM_ARGS_ENV = "ROLLOUTS_VLLM_ENGINE_ARGS"
# vllm-http: the servers, comma-separated base URLs (--model, if given, names their model
# directory so prompts and checkpoints are checked locally).
VLLM_SERVERS_ENV = "ROLLOUTS_VLLM_SERVERS"
# synthetic: SyntheticEngine keyword arguments as a JSON object, e.g. '{"token_delay_s": 0.005,
# "tokens_per_chunk": 1, "poison_token": 7}' (paced so that process tests can kill a worker
# mid-generation; a poison token fails every request whose prompt holds it).
SYNTHETIC_ARGS_ENV = "ROLLOUTS_SYNTHETIC_ENGINE"


def make_engine(
    name: str, model: str | None, *, weight_version: int = 0, servers: list[str] | None = None
) -> Engine:
    if name == "cpu":
        if not model:
            raise ValueError("--engine cpu needs --model DIR (see `rollouts make-tiny-model`)")
        from workers.engines.cpu.engine import CpuEngine  # noqa: PLC0415  (torch: import on demand)

        return CpuEngine(model, weight_version=weight_version)
    if name == "synthetic":
        from workers.engines.synthetic import SyntheticEngine  # noqa: PLC0415

        options = json.loads(os.environ.get(SYNTHETIC_ARGS_ENV) or "{}")
        if not isinstance(options, dict):
            raise ValueError(f"{SYNTHETIC_ARGS_ENV} must be a JSON object")
        return SyntheticEngine(weight_version=weight_version, **options)
    if name == "vllm":
        return _make_vllm(model, weight_version)
    if name == "vllm-http":
        from workers.engines.vllm.http import VllmHttpEngine  # noqa: PLC0415  (aiohttp)

        urls = servers or [u for u in os.environ.get(VLLM_SERVERS_ENV, "").split(",") if u]
        if not urls:
            raise ValueError(f"--engine vllm-http needs server URLs in {VLLM_SERVERS_ENV}")
        return VllmHttpEngine(urls, model_dir=model, weight_version=weight_version)
    raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")


def _make_vllm(model: str | None, weight_version: int) -> Engine:
    if not model:
        raise ValueError("--engine vllm needs --model DIR")
    from workers.engines.vllm.local import VllmEngine, VllmOptions  # noqa: PLC0415  (vllm)

    extra = json.loads(os.environ.get(VLLM_ARGS_ENV) or "{}")
    if not isinstance(extra, dict):
        raise ValueError(f"{VLLM_ARGS_ENV} must be a JSON object")
    known = {f for f in VllmOptions.__dataclass_fields__ if f != "extra"}
    options = VllmOptions(
        **{k: v for k, v in extra.items() if k in known},
        extra=tuple((k, v) for k, v in extra.items() if k not in known),
    )
    return VllmEngine(model, weight_version=weight_version, options=options)
