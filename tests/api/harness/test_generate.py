"""/inference/v1/generate and /skyrl/v1/generate: vLLM's GenerateTokensResponse from one
durable call, every answer as the served /openapi.json documents it, every field we cannot
honour refused by name (and nothing recorded), overload answered as SkyRL retries it."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.conftest import MakeHarness
from tests.workers.helpers import start_worker, stop

ROUTES = ("/inference/v1/generate", "/skyrl/v1/generate")
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# What SkyRL's RemoteInferenceClient sends beside its own values (neutral ones).
SKYRL_EXTRAS = {"min_tokens": 0, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "top_k": -1, "min_p": 0.0,
                "logprobs": None, "stop": None, "top_p": 1.0}  # fmt: skip


async def documented(api: TestClient, path: str, status: int, body: Any) -> None:
    doc = await (await api.get("/openapi.json")).json()
    op = doc["paths"][path]["post" if path != "/v1/models" else "get"]
    schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
    full = {**schema, "components": doc["components"]}
    errors = list(jsonschema.Draft202012Validator(full).iter_errors(body))
    assert not errors, errors[0].message


@pytest.mark.parametrize("path", ROUTES)
async def test_a_call_is_one_rollout_answered_as_vllm_does(
    make_harness: MakeHarness, worker: subprocess.Popen[bytes], trainer: RolloutClient, path: str
) -> None:
    api = await make_harness()
    body = {"token_ids": [5, 6, 7], "sampling_params": {**SKYRL_EXTRAS, **GREEDY, "logprobs": 0},
            "model": "m", "return_token_ids": True}  # fmt: skip
    r = await api.post(path, json=body, headers={"X-Session-ID": "traj-1"})
    raw = await r.read()
    assert r.status == 200, raw
    assert b": " not in raw and b", " not in raw  # compact JSON (SkyRL's scan needs it)
    out = json.loads(raw)
    await documented(api, path, 200, out)
    (choice,) = out["choices"]
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    assert out["prompt_token_ids"] == [5, 6, 7]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 8}]
    # One rollout recorded, with its session; equal to the trainer API's own greedy run.
    (batch_id,) = await trainer.batches()
    info = await trainer.batch(batch_id)
    (rid,) = info.ids
    result = await trainer.result(rid)
    assert result.metadata["session"] == "traj-1"
    assert result.response_token_ids.tolist() == choice["token_ids"]
    # The same call again (SkyRL's retry: same body and session) attaches: still one rollout.
    again = await (await api.post(path, json=body, headers={"X-Session-ID": "traj-1"})).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    assert await trainer.batches() == [batch_id]


async def test_n_is_a_group_and_stream_is_sse(
    make_harness: MakeHarness, worker: subprocess.Popen[bytes]
) -> None:
    api = await make_harness()
    body = {"token_ids": [9, 9], "sampling_params": {**GREEDY, "n": 3, "temperature": 1.0,
            "seed": 4}, "stream": True, "request_id": "grp-1"}  # fmt: skip
    r = await api.post("/inference/v1/generate", json=body)
    assert r.status == 200 and r.content_type == "text/event-stream"
    events = [e for e in (await r.text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 2]
    assert all(len(c["choices"][0]["token_ids"]) == 8 for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert {c["request_id"] for c in chunks} == {"grp-1"}


REFUSED = [
    ({"presence_penalty": 0.5}, "sampling_params.presence_penalty"),
    ({"min_p": 0.1}, "sampling_params.min_p"),
    ({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty"),
    ({"logit_bias": {"3": 1.0}}, "sampling_params.logit_bias"),
    ({"structured_outputs": {"json": {}}}, "sampling_params.structured_outputs"),
    ({"prompt_logprobs": 1}, "sampling_params.prompt_logprobs"),
    ({"bad_words": ["x"]}, "sampling_params.bad_words"),
    ({"no_such_param": 1}, "sampling_params.no_such_param"),
    # JSON's types, not Python's: true is not the integer 1, nor false the neutral 0.
    ({"stream_interval": True}, "sampling_params.stream_interval"),
    ({"presence_penalty": False}, "sampling_params.presence_penalty"),
    ({"detokenize": 1}, "sampling_params.detokenize"),
    ({"routed_experts_prompt_start": 0}, "sampling_params.routed_experts_prompt_start"),
    ({"n": 0}, "sampling_params.n"),
    ({"temperature": -1.0}, "sampling_params.temperature"),
]


@pytest.mark.parametrize(("extra", "field"), REFUSED, ids=[f for _, f in REFUSED])
async def test_what_we_cannot_honour_is_refused_by_name(
    make_harness: MakeHarness, trainer: RolloutClient, extra: dict[str, Any], field: str
) -> None:
    api = await make_harness()
    body = {"token_ids": [1, 2], "sampling_params": {**GREEDY, **extra}}
    r = await api.post("/skyrl/v1/generate", json=body)
    out = await r.json()
    assert r.status == 422, out
    assert (
        out["error"]["param"] == field
        and field.rsplit(".", maxsplit=1)[-1] in out["error"]["message"]
    )
    await documented(api, "/skyrl/v1/generate", 422, out)
    assert await trainer.batches() == []  # nothing recorded


TOP_REFUSED = [
    ({"output_mode": "text"}, "output_mode"), ({"priority": 1}, "priority"),
    ({"features": {"mm_hashes": {}}}, "features"),
    ({"kv_transfer_params": {}}, "kv_transfer_params"),
    ({"token_ids": []}, "token_ids"), ({"surprise": 1}, "surprise"),
]  # fmt: skip


@pytest.mark.parametrize(("top", "field"), TOP_REFUSED)
async def test_top_level_fields_we_cannot_serve_are_refused_by_name(
    make_harness: MakeHarness, trainer: RolloutClient, top: dict[str, Any], field: str
) -> None:
    api = await make_harness()
    r = await api.post("/inference/v1/generate",
                       json={"token_ids": [1], "sampling_params": GREEDY, **top})  # fmt: skip
    out = await r.json()
    assert r.status == 422 and out["error"]["param"] == field, out
    assert await trainer.batches() == []


async def test_without_max_tokens_a_call_fills_the_workers_context(
    make_harness: MakeHarness, api_redis: RedisServer, tmp_path: Path
) -> None:
    """As vLLM's server: no max_tokens is what the context leaves, even where this API does
    not know the context (the worker does: its model's, here the synthetic engine's 24)."""
    from store.api.harness.served import ServedModel

    proc = start_worker(api_redis.url, None, "hctx", tmp_path / "w.log",
                        synthetic={"context_length": 24})  # fmt: skip
    try:
        api = await make_harness(served=ServedModel())
        r = await api.post("/inference/v1/generate",
                           json={"token_ids": [1, 2, 3, 4], "sampling_params": {}})  # fmt: skip
        out = await r.json()
        assert r.status == 200, out
        assert len(out["choices"][0]["token_ids"]) == 20  # 24 - the prompt's 4
        assert out["choices"][0]["finish_reason"] == "length"
    finally:
        stop(proc)


async def test_routes_from_a_prompt_start_are_vllms_rows(
    make_harness: MakeHarness, api_redis: RedisServer, redis: object, tmp_path: Path
) -> None:
    """vLLM's rows run from routed_experts_prompt_start to the last token excluded; ours are
    the output tokens' (row t: the forward at position len(prompt) - 1 + t). So the last
    prompt position is all our rows, the prompt's end all but the first (SkyRL's trace needs
    len(prompt) - start + generated - 1 rows); earlier starts are refused by name."""
    proc = start_worker(api_redis.url, None, "hmoe", tmp_path / "w.log",
                        synthetic={"experts": 8, "token_delay_s": 0.0})  # fmt: skip
    try:
        api = await make_harness()
        prompt, answers = [4, 5, 6], {}
        for start in (None, 2, 3):
            params = (
                {**GREEDY} if start is None else {**GREEDY, "routed_experts_prompt_start": start}
            )
            for path in ROUTES:
                r = await api.post(path, json={"token_ids": prompt, "sampling_params": params})
                out = await r.json()
                assert r.status == 200, out
                routed = out["choices"][0]["routed_experts"]
                if path == "/skyrl/v1/generate":
                    raw = np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"])
                    answers[start, path] = raw.reshape(routed["shape"])
                else:
                    answers[start, path] = np.load(io.BytesIO(base64.b64decode(routed)))
        for path in ROUTES:
            full = answers[None, path]
            assert full.shape == (8, 2, 2)
            assert np.array_equal(answers[2, path], full)
            assert np.array_equal(answers[3, path], full[1:])
        body = {
            "token_ids": prompt,
            "sampling_params": {**GREEDY, "routed_experts_prompt_start": 1},
        }
        r = await api.post("/skyrl/v1/generate", json=body)
        assert r.status == 422
        assert (await r.json())["error"]["param"] == "sampling_params.routed_experts_prompt_start"
    finally:
        stop(proc)


async def test_overload_is_a_non_json_503_skyrl_retries(make_harness: MakeHarness) -> None:
    api = await make_harness(max_waiting=0)
    r = await api.post("/skyrl/v1/generate", json={"token_ids": [1], "sampling_params": GREEDY})
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    with pytest.raises(json.JSONDecodeError):
        json.loads(await r.text())  # SkyRL's client retries only a 5xx it cannot parse
