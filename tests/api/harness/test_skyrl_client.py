"""SkyRL's own client (skyrl 0.3.0's RemoteInferenceClient, as installed with
``pip install --no-deps skyrl==0.3.0`` + aiohttp, pydantic, cloudpathlib) against the harness
routes and a real worker process: its answer equals the trainer API's greedy run.

skyrl 0.3.0's ``skyrl/backends/__init__.py`` does not import on Python 3.11 (a pydantic
TypedDict of its Tinker types): the client module is imported with that package's __init__
skipped; the client code itself runs unmodified. skyrl 0.4.0's client (Python >= 3.12, the
packed routed-experts codec) runs in an environment of its own: test_skyrl040_client.py."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import types

import pytest

from statemachine import RolloutRequest, SamplingParams, Status
from store.client import RolloutClient
from tests.api.harness.conftest import MakeHarness
from tests.vllm_plugin import REQUIRE_ENV
from tests.workers.helpers import until


def remote_client_class() -> type:
    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        # As the vLLM tests: skipped on a machine set up for the demo only, a failure where
        # the full suite must run (CI sets the variable, and installs skyrl as README says).
        why = "skyrl 0.3.0 is not installed (pip install --no-deps skyrl==0.3.0 cloudpathlib)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why)
    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [os.path.join(os.path.dirname(spec.origin), "backends")]
    sys.modules.setdefault("skyrl.backends", backends)
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )

    return RemoteInferenceClient


@pytest.mark.parametrize("routes", [False, True], ids=["inference", "skyrl"])
async def test_skyrls_client_gets_the_uninterrupted_greedy_answer(
    make_harness: MakeHarness, worker: subprocess.Popen[bytes], trainer: RolloutClient,
    routes: bool,
) -> None:  # fmt: skip
    client_cls = remote_client_class()
    api = await make_harness()
    base = str(api.make_url("")).rstrip("/")
    client = client_cls(proxy_url=base, server_urls=[base], model_name="tiny",
                        enable_return_routed_experts=routes, data_parallel_size=1)  # fmt: skip
    prompts = [[3, 4, 5], [8, 1]]
    sampling = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                "min_tokens": 0, "top_k": -1, "min_p": 0.0, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "stop": None}  # fmt: skip
    try:
        # SkyRL detokenizes every response over /detokenize unless it has a tokenizer.
        client.tokenizer = types.SimpleNamespace(batch_decode=lambda ids: ["" for _ in ids])
        out = await client.generate({"prompt_token_ids": prompts, "sampling_params": sampling,
                                     "session_ids": ["s1", "s2"]})  # fmt: skip
        await client.resume()
        world = await client.get_world_size()
    finally:
        await client.teardown()
    assert world == (1, 1)
    assert out["response_ids"] == await _greedy_reference(trainer, prompts, 12)
    assert out["stop_reasons"] == ["length", "length"]
    assert [len(lp) for lp in out["response_logprobs"]] == [12, 12]


async def test_skyrls_pause_abort_and_resume_leave_its_calls_whole(
    make_harness: MakeHarness, worker: subprocess.Popen[bytes], trainer: RolloutClient
) -> None:
    # SkyRL's own pause(mode="abort") (it sends clear_cache too) mid-call: the worker aborts
    # the call's rollouts with their progress kept; the call waits, and after SkyRL's resume()
    # answers whole, with the greedy tokens of an uninterrupted run. pause(mode="wait") then
    # answers once nothing runs.
    client_cls = remote_client_class()
    api = await make_harness()
    base = str(api.make_url("")).rstrip("/")
    client = client_cls(proxy_url=base, server_urls=[base], model_name="tiny",
                        data_parallel_size=1)  # fmt: skip
    client.tokenizer = types.SimpleNamespace(batch_decode=lambda ids: ["" for _ in ids])
    prompts = [[3, 4, 5], [8, 1]]
    sampling = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    try:
        call = asyncio.ensure_future(client.generate({"prompt_token_ids": prompts,
                                                      "sampling_params": sampling}))  # fmt: skip
        await until(lambda: _tokens_live(trainer, 2), what="the call never started")
        await client.pause(mode="abort")
        await until(lambda: _paused_aborts(trainer, 2), 10, "not aborted for the pause")
        await asyncio.sleep(1.0)
        assert not call.done()  # the call waits through the pause, never answers "abort"
        stats = await trainer.stats()
        assert stats.by_state[Status.ABORTED] == 2 and stats.in_flight == 0
        await client.resume()
        out = await asyncio.wait_for(call, 60)
        waited = await client.pause(mode="wait")
        assert [r["body"]["running"] for r in waited.values()] == [0]
        await client.resume()
    finally:
        await client.teardown()
    assert out["response_ids"] == await _greedy_reference(trainer, prompts, 400)
    assert out["stop_reasons"] == ["length", "length"]


async def _greedy_reference(
    trainer: RolloutClient, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The trainer API's uninterrupted greedy answers to ``prompts``: what SkyRL must get."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    direct = await trainer.submit(
        [RolloutRequest(prompt_token_ids=tuple(p), sampling=sampling) for p in prompts]
    )
    return [r.response_token_ids.tolist() for r in await trainer.wait(list(direct), timeout=60)]


async def _tokens_live(trainer: RolloutClient, n: int) -> bool:
    return (await trainer.stats()).in_flight == n and (await trainer.stats()).tokens >= 2 * n


async def _paused_aborts(trainer: RolloutClient, n: int) -> bool:
    return (await trainer.stats()).by_state[Status.ABORTED] == n
