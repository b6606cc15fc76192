"""What harness clients call around generation: /v1/models, /tokenize, /detokenize, /health,
SkyRL's control plane (pause/resume as the store's pause flag, update_weights publishing the
next version), and a 404 naming what is not served. Plus the routes' two wire forms."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json

import numpy as np
from transformers import AutoTokenizer

from statemachine import RolloutRequest, SamplingParams, Status
from store.api.harness import forms
from store.api.harness.served import ServedModel
from store.client import RolloutClient
from store.pause import PauseFlag
from tests.api.harness.conftest import MakeHarness
from tests.api.harness.test_generate import documented
from tests.workers.helpers import until


async def test_models_tokenize_detokenize(
    make_harness: MakeHarness, tiny_dense_dir: object
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dense_dir)
    api = await make_harness(tokenizer=tok, served=ServedModel("tiny", 128, strict_name=True))
    models = await (await api.get("/v1/models")).json()
    await documented(api, "/v1/models", 200, models)
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
    r = await api.post("/tokenize", json={"model": "tiny", "prompt": "hello world"})
    out = await r.json()
    assert out["tokens"] == tok("hello world")["input_ids"] and out["count"] == len(out["tokens"])
    back = await (await api.post("/detokenize", json={"tokens": out["tokens"]})).json()
    assert back == {"prompt": tok.decode(out["tokens"])}
    wrong = await api.post("/detokenize", json={"model": "other", "tokens": [1]})
    assert wrong.status == 404 and (await wrong.json())["error"]["param"] == "model"


async def test_without_a_tokenizer_tokenize_is_a_named_4xx(make_harness: MakeHarness) -> None:
    api = await make_harness()
    r = await api.post("/detokenize", json={"tokens": [1, 2]})
    out = await r.json()
    assert r.status == 422 and out["error"]["type"] == "no_tokenizer", out
    assert out["error"]["param"] == "tokens"


async def test_pause_resume_update_weights(
    make_harness: MakeHarness, trainer: RolloutClient
) -> None:
    api = await make_harness()
    flag = PauseFlag(trainer.redis, trainer.keys)
    r = await api.post("/pause?mode=abort&clear_cache=false")
    assert r.status == 200 and (await r.json())["paused"] is True
    assert (await flag.current()).mode == "abort"  # type: ignore[union-attr]
    assert (await api.post("/pause?mode=sideways")).status == 422
    assert (await (await api.post("/resume")).json())["paused"] is False
    assert await flag.current() is None
    for expected in (1, 2):
        out = await (await api.post("/update_weights", json={"weight_dir": "/ckpt"})).json()
        assert out["weight_version"] == expected
    latest = await trainer.weights.latest()
    assert latest is not None and (latest.version, latest.path) == (2, "/ckpt")
    assert (await (await api.get("/get_world_size")).json()) == {"world_size": 1}
    assert (await (await api.get("/is_sleeping")).json()) == {"is_sleeping": False}
    assert (await api.get("/health")).status == 200


async def test_other_control_paths_say_they_are_not_served(make_harness: MakeHarness) -> None:
    api = await make_harness()
    for path in ("/sleep", "/init_weight_transfer", "/wake_up"):
        r = await api.post(path)
        out = await r.json()
        assert r.status == 404 and "does not serve" in out["error"]["message"], out
    plain = await api.post("/no/such/route")
    assert plain.status == 404 and "does not serve" not in await plain.text()


async def test_finish_session_forgets_the_sessions_worker(
    make_harness: MakeHarness, trainer: RolloutClient
) -> None:
    """SkyRL calls ``POST /finish_session?session_id=`` for every trajectory it ends (a 404
    there is a warning in its log per trajectory): the session's calls stop preferring the
    worker that served them, and stay listed until acknowledged."""
    api = await make_harness()
    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    call = asyncio.ensure_future(api.post("/inference/v1/generate", json=body,
                                          headers={"X-Session-ID": "traj-1"}))  # fmt: skip
    keys, redis = trainer.keys, trainer.redis
    await until(lambda: _listed(trainer, "traj-1"))
    await redis.set(keys.session_worker("traj-1"), "w-a", xx=True, keepttl=True)  # as a start does
    r = await api.post("/finish_session", params={"session_id": "traj-1"})
    out = await r.json()
    assert r.status == 200 and out == {"session_id": "traj-1", "released": True}, out
    await documented(api, "/finish_session", 200, out)
    assert await redis.exists(keys.session_worker("traj-1")) == 0
    assert [c.batch_id for c in await trainer.session("traj-1")]  # the call is still listed
    # Unknown sessions are ignored, as SkyRL expects; a bad or missing id is a named 422.
    again = await api.post("/finish_session", params={"session_id": "never-seen"})
    assert again.status == 200 and (await again.json())["released"] is False
    for params in ({}, {"session_id": "a\nb"}, {"session_id": "x", "other": "1"}):
        bad = await api.post("/finish_session", params=params)
        assert bad.status == 422, (params, await bad.text())
        assert "session_id" in (await bad.text()) or "other" in (await bad.text())
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call


async def _listed(trainer: RolloutClient, session: str) -> bool:
    return bool(await trainer.session(session))


def test_routes_in_vllms_npy_and_skyrls_packed_forms() -> None:
    routed = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3) % 8
    decoded = np.load(io.BytesIO(base64.b64decode(forms.npy_base64(routed))))
    assert np.array_equal(decoded, routed)
    packed = forms.packed_routes(routed)
    assert list(packed) == ["data", "shape", "dtype"] and packed["dtype"] == "uint8"
    raw = forms.compact_json({"choices": [{"routed_experts": packed, "index": 0}]})
    # SkyRL's load_packed_body finds the blob by this anchor in the raw reply.
    anchor = b'"routed_experts":{"data":"'
    start = raw.index(anchor) + len(anchor)
    blob = raw[start : raw.index(b'"', start)]
    back = np.frombuffer(base64.b64decode(blob), dtype=packed["dtype"]).reshape(packed["shape"])
    assert np.array_equal(back, routed)
    assert forms.packed_routes(routed + 300)["dtype"] == "int16"
    assert forms.packed_routes(routed + 70000)["dtype"] == "int32"
    assert json.loads(raw)["choices"][0]["routed_experts"]["shape"] == [5, 2, 3]


async def test_pause_wait_answers_once_no_rollout_runs(
    make_harness: MakeHarness, trainer: RolloutClient, worker: object
) -> None:
    # A real worker process (synthetic engine, 200 tokens/s): /pause?mode=wait answers when
    # the rollout running on it has finished, not before; with a timeout it answers a 504
    # saying how many still run, and the pause holds.
    api = await make_harness()
    sampling = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)  # 2.5 s
    [rid] = await trainer.submit([RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=sampling)])
    await until(lambda: _tokens(trainer, rid), what="never started")
    short = await api.post("/pause?mode=wait&timeout=0.3")
    body = await short.json()
    assert short.status == 504 and body["error"]["type"] == "still_running", body
    assert "but 1 rollouts still run after 0.3 s" in body["error"]["message"]
    assert (await trainer.store.load(rid)).status is Status.GENERATING
    r = await api.post("/pause?mode=wait")
    out = await r.json()
    assert r.status == 200 and out["paused"] is True and out["mode"] == "wait", out
    assert out["running"] == 0 and out["since"] is not None
    assert (await trainer.store.load(rid)).status is Status.DONE
    await documented(api, "/pause", 200, out)
    # Idle already: it answers at once (within a beat of the workers).
    again = await api.post("/pause?mode=wait&timeout=5")
    assert again.status == 200 and (await again.json())["since"] == out["since"]
    assert (await (await api.post("/resume")).json())["paused"] is False


async def _tokens(trainer: RolloutClient, rid: str) -> bool:
    return (await trainer.store.load(rid)).num_tokens > 0
