"""Runs SkyRL 0.4.0's own client code against a ``rollouts api``, under the Python (>= 3.12)
of the environment ``tests/api/harness/skyrl040/environment.py`` builds; never imported by
the project's own Python (3.11), which cannot import SkyRL 0.4.0.

Usage: ``python driver.py SPEC_JSON``; ``SPEC_JSON`` is ``{"base": url, "model": name,
"max_tokens": n, "calls": [{"prompt": [ids], "session": id, "routes": bool, "prompt_start":
int (optional)}]}``. Each call is ``RemoteGenerateClient.generate`` with SkyRL's usual greedy
sampling params (its generator's own), ``return_routed_experts`` and
``routed_experts_prompt_start`` as asked (SkyRL posts ``/skyrl/v1/generate`` with it, and
decodes the reply with ``load_packed_body`` and ``decode_packed_routed_experts``;
``/inference/v1/generate`` without). Then the control plane through ``RemoteInferenceClient``:
``pause`` (keep), ``resume``, ``get_world_size``. Prints one JSON object: per call the token ids,
logprobs, stop reason and routes (nested lists, with their shape and dtype as decoded), and
the control plane's answers.
"""

import asyncio
import json
import sys
from pathlib import Path

# The stand-in torch (see its docstring): SkyRL's client module imports torch, never uses it.
sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_standin"))

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteGenerateClient,
    RemoteInferenceClient,
)


def sampling_params(max_tokens: int) -> dict[str, object]:
    # What SkyRL's generator sends for a greedy rollout with the sampled tokens' logprobs.
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
            "min_tokens": 0, "top_k": -1, "min_p": 0.0, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "stop": None}  # fmt: skip


async def main(spec: dict) -> dict:
    generate = RemoteGenerateClient(proxy_url=spec["base"])
    calls = []
    try:
        for call in spec["calls"]:
            result = await generate.generate(
                prompt_token_ids=call["prompt"],
                sampling_params=sampling_params(spec["max_tokens"]),
                session_id=call["session"],
                model=spec["model"],
                return_routed_experts=call["routes"],
                routed_experts_prompt_start=call.get("prompt_start"),
            )
            routes = result.routed_experts
            calls.append({
                "token_ids": result.response_ids,
                "logprobs": result.response_logprobs,
                "stop_reason": result.stop_reason,
                "routes": None if routes is None else routes.tolist(),
                "shape": None if routes is None else list(routes.shape),
                "dtype": None if routes is None else routes.dtype.name,
            })  # fmt: skip
    finally:
        await generate.aclose()
    control = RemoteInferenceClient(proxy_url=spec["base"], server_urls=[spec["base"]],
                                    data_parallel_size=1, model_name=spec["model"])  # fmt: skip
    try:
        paused = await control.pause(mode="keep")
        resumed = await control.resume()
        world = await control.get_world_size()
    finally:
        await control.teardown()
    base = spec["base"]
    return {"calls": calls, "world_size": list(world), "pause": paused[base]["status"],
            "resume": resumed[base]["status"]}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
