"""SkyRL 0.4.0's own client code (``RemoteGenerateClient.generate``, and
``RemoteInferenceClient``'s ``pause``/``resume``/``get_world_size``) against a real
``rollouts api`` process, a real redis-server and a real worker process whose engine routes
experts (the synthetic engine: ``experts`` set). 0.4.0 is the release with the packed
routed-experts codec: ``/skyrl/v1/generate``'s reply goes through its own ``load_packed_body``
(the raw scan for ``"routed_experts":{"data":"``) and ``decode_packed_routed_experts`` (which
refuses any dtype but the smallest of uint8/int16/int32), ``/inference/v1/generate``'s
through its plain path. Its answer equals the trainer API's run of the same greedy request:
the same tokens, logprobs and, for the output tokens, routes; with a
``routed_experts_prompt_start`` (SkyRL's generator sends one every turn), vLLM's rows from it.

SkyRL 0.4.0 needs Python >= 3.12 (the project's venv is 3.11) and imports torch: the client
runs in an environment of its own (``skyrl040/environment.py``: built once, ~1 min, cached
outside the repository; ``$ROLLOUTS_SKYRL040_PYTHON`` names a ready one) with a stand-in torch
(``skyrl040/torch_standin``), in a subprocess (``skyrl040/driver.py``) that prints what the
client decoded as JSON. Skipped where no Python 3.12+ or PyPI is at hand; a failure where the
full suite must run (``ROLLOUTS_REQUIRE_VLLM=1``, as CI sets it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.redis_server import RedisServer, free_port
from tests.api.harness.conftest import REPO, Api, wait_healthy
from tests.api.harness.skyrl040 import environment
from tests.api.test_process import api_command
from tests.vllm_plugin import REQUIRE_ENV
from tests.workers.helpers import start_worker, stop

# The synthetic engine unpaced; its routes ``(position + [0 .. layers * top_k)) % experts``.
LAYERS, TOP_K = 2, 2
MODEL = "/models/skyrl-policy"  # SkyRL sends its model's path; the API accepts any name
# The first test of a session may build the environment (~1 min, minutes on a loaded CI run).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("skyrl040"), pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def skyrl040_python() -> Path:
    try:
        return environment.python()
    except environment.Unavailable as exc:
        why = f"SkyRL 0.4.0's client environment is unavailable: {exc}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why)


def run_driver(python: Path, spec: dict[str, object]) -> dict[str, object]:
    done = subprocess.run([str(python), str(environment.DRIVER), json.dumps(spec)],
                          check=False, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return out


# Experts and response length: ids up to 14 (uint8); with 300 experts and 260 tokens, ids up
# to 262 (int16): SkyRL's decoder refuses anything but the smallest dtype.
@pytest.mark.parametrize(
    ("experts", "max_tokens", "dtype"), [(8, 12, "uint8"), (300, 260, "int16")],
    ids=["uint8", "int16"],
)  # fmt: skip
async def test_skyrl040s_client_decodes_the_uninterrupted_greedy_answer(
    skyrl040_python: Path, tmp_path: Path, experts: int, max_tokens: int, dtype: str
) -> None:
    prompts = [[3, 4, 5], [8, 1]]
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTS_API_TOKEN"} | {"PYTHONPATH": path}
    with RedisServer(tmp_path / "redis") as server:
        synthetic = {"experts": experts, "layers": LAYERS, "top_k": TOP_K,
                     "token_delay_s": 0.0, "tokens_per_chunk": 16}  # fmt: skip
        worker = start_worker(server.url, None, "sk040", tmp_path / "worker.log",
                              synthetic=synthetic, env=env)  # fmt: skip
        port, log = free_port(), tmp_path / "api.log"
        proc = subprocess.Popen(api_command(server.url, port), env=env, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT)  # fmt: skip
        api = Api(f"http://127.0.0.1:{port}", proc, log)
        trainer = RolloutClient(server.url)
        try:
            await asyncio.to_thread(wait_healthy, api)
            # The first call with routes (/skyrl/v1/generate), the second without
            # (/inference/v1/generate); each its own session, as SkyRL's trajectories are.
            # Then routes from a prompt start (SkyRL's generator sends one on every turn):
            # vLLM's rows cover the input positions from it to the last token excluded.
            start = len(prompts[0])
            calls = [{"prompt": prompts[0], "session": "traj-0", "routes": True},
                     {"prompt": prompts[1], "session": "traj-1", "routes": False},
                     {"prompt": prompts[0], "session": "traj-2", "routes": True,
                      "prompt_start": start - 1},
                     {"prompt": prompts[0], "session": "traj-3", "routes": True,
                      "prompt_start": start}]  # fmt: skip
            spec = {"base": api.base, "model": MODEL, "max_tokens": max_tokens, "calls": calls}
            out = await asyncio.to_thread(run_driver, skyrl040_python, spec)
            greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids = await trainer.submit([RolloutRequest(prompt_token_ids=tuple(p), sampling=greedy)
                                        for p in prompts])  # fmt: skip
            reference = await trainer.wait(list(ids), timeout=120)
            metrics = await asyncio.to_thread(fetch, f"{api.base}/metrics")
        finally:
            await trainer.aclose()
            stop(worker, proc)
    answers = out["calls"]
    assert isinstance(answers, list) and len(answers) == 4
    for call, ref in zip(answers, [*reference, reference[0], reference[0]], strict=True):
        assert call["token_ids"] == ref.response_token_ids.tolist()
        assert len(call["token_ids"]) == max_tokens
        assert call["stop_reason"] == "length"
        np.testing.assert_allclose(call["logprobs"], ref.logprobs, rtol=0, atol=1e-6)
    routed, plain, from_last, from_end = answers
    assert reference[0].routed_experts is not None
    assert routed["shape"] == [max_tokens, LAYERS, TOP_K]
    assert routed["dtype"] == dtype
    assert routed["routes"] == reference[0].routed_experts.tolist()
    assert plain["routes"] is None  # /inference/v1/generate: SkyRL asked for none
    # Our rows are the output tokens' (row t: the forward pass that produced token t, at input
    # position len(prompt) - 1 + t): vLLM's answer from the last prompt position. From the
    # prompt's end vLLM has one row fewer, len(prompt) - start + generated - 1, which is what
    # SkyRL's RoutedExpertTrace.record_generation requires.
    assert from_last["routes"] == routed["routes"] and from_last["dtype"] == dtype
    assert from_end["shape"] == [max_tokens - 1, LAYERS, TOP_K]
    assert from_end["routes"] == reference[0].routed_experts[1:].tolist()
    # The control plane: keep-mode pause and resume answered 200, one server of world size 1.
    assert out["pause"] == 200 and out["resume"] == 200
    assert out["world_size"] == [1, 1]
    # Each route answered its call (the API's own counters).
    assert answered(metrics, "/skyrl/v1/generate") == 3
    for route in ("/inference/v1/generate", "/pause", "/resume", "/get_world_size"):
        assert answered(metrics, route) == 1, route


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def answered(metrics: str, route: str) -> float:
    """Requests of ``route`` answered 200, from the API's Prometheus text."""
    total = 0.0
    for line in metrics.splitlines():
        m = re.match(r"rollouts_api_requests_total\{(.*)\} (\S+)$", line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1])) if m else {}
        if m and labels.get("route") == route and labels.get("status") == "200":
            total += float(m[2])
    return total
