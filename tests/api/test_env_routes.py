"""The environment routes over HTTP, on fakeredis and a real redis-server: an episode submitted
over HTTP waits at a tool call (its worker's events appended directly), a runner claims it,
heartbeats, records its result (the next turn's generation job pushed in the same step); a
second runner finds nothing; a fenced-out runner's late report is refused with nothing
written; failures by class; every answer as the served document declares it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp import web

from statemachine import EpisodeSpec, FailureClass, Status, commands, episode_commands
from statemachine.episode_events import ToolCallClaimed, ToolResultRecorded
from store.api.app import make_app
from store.redis_server import free_port
from store.tool_sweep import sweep_lost_calls
from tests.api.env_helpers import EnvApi, documented
from tests.api.helpers import MSGPACK, dump_all

CLAIM = "/v1/env/{queue}/claim"
CALL = "/v1/env/calls/{rollout_id}/{call_id}"


async def _doc(env_api: EnvApi) -> dict[str, Any]:
    return dict(await (await env_api.http.get("/openapi.json")).json())


async def test_an_episode_submitted_over_http_is_recorded_with_its_spec(env_api: EnvApi) -> None:
    await env_api.submit("ep", max_turns=4, max_wall_seconds=60.0)
    state = await env_api.env.store.load("ep")
    assert state.status is Status.PENDING and state.request.episode == EpisodeSpec.from_dict({
        "tool_call_stop_token_ids": [7], "env_queue": "box", "max_turns": 4,
        "max_wall_seconds": 60.0,
        "tools": [{"name": "calc", "effect": "idempotent"}, {"name": "send", "effect": "restart"}],
    })  # fmt: skip
    r = await env_api.http.get("/v1/rollouts/ep")
    assert r.status == 200 and (await r.json())["status"] == "pending"


async def test_claim_heartbeat_and_result_make_the_next_turn_runnable(env_api: EnvApi) -> None:
    doc = await _doc(env_api)
    await env_api.submit()
    waiting = await env_api.at_tool()
    assert waiting.status is Status.AWAITING_TOOL
    jobs = env_api.jobs(waiting)  # the submit's first-turn job (no worker took it)
    # Two runners at once: exactly one gets the call, the other (waiting 0.3 s) nothing.
    t0 = time.monotonic()
    a, b = await asyncio.gather(
        env_api.http.post("/v1/env/box/claim", json={"runner_id": "r1"}),
        env_api.http.post("/v1/env/box/claim", json={"runner_id": "r2", "timeout_s": 0.3}),
    )
    assert sorted([a.status, b.status]) == [200, 204]
    won, lost = (a, b) if a.status == 200 else (b, a)
    claim = await won.json()
    assert await lost.read() == b"" and time.monotonic() - t0 >= 0.3 - 0.05
    assert claim == {
        "rollout_id": "ep", "call_id": "call-1", "claim": 1, "runner_id": claim["runner_id"],
        "name": "calc", "arguments": '{"x": 1}', "idempotency_key": "ep/call-1",
        "effect": "idempotent", "env_handle": "", "env_revision": "", "restore": False,
        "lease_s": 15.0,
    }  # fmt: skip
    documented(doc, CLAIM, 200, claim)
    documented(doc, CLAIM, 204, None)
    assert (await env_api.env.store.head("ep")).status is Status.RUNNING_TOOL

    status, beat = await env_api.report("ep", "call-1", "heartbeat", {"claim": 1, "lease_s": 20})
    assert status == 200 and beat == {"rollout_id": "ep", "call_id": "call-1", "claim": 1,
                                      "lease_s": 20}  # fmt: skip
    documented(doc, f"{CALL}/heartbeat", 200, beat)

    result = {"claim": 1, "observation_token_ids": [900, 901, 902], "seconds": 0.25,
              "env_handle": "sandbox-3", "env_revision": "v1"}  # fmt: skip
    status, after = await env_api.report("ep", "call-1", "result", result)
    assert status == 200 and after == {"rollout_id": "ep", "call_id": "call-1",
                                       "status": "next_turn", "finish_reason": None,
                                       "failure": None, "error": None}  # fmt: skip
    documented(doc, f"{CALL}/result", 200, after)
    state = await env_api.env.store.load("ep")
    recorded = state.calls[0].result
    assert recorded is not None and recorded.env_revision == "v1" and recorded.seconds == 0.25
    assert recorded.observation_token_ids.tolist() == [900, 901, 902]
    # The next turn's generation job, pushed with the result.
    [new_job] = set(env_api.jobs(state)) - set(jobs)
    assert new_job.encode() in await env_api.redis.hget(env_api.client.keys.snapshot("ep"), "job")
    # Between turns, a rollout's view says so, as documented.
    r = await env_api.http.get("/v1/rollouts/ep")
    view = await r.json()
    assert r.status == 200 and view["status"] == "next_turn"
    documented(doc, "/v1/rollouts/{rollout_id}", 200, view, "get")
    # Nothing is left to claim.
    await env_api.claim("r2", 204)


async def test_a_fenced_out_runners_late_reports_are_409_and_write_nothing(
    env_api: EnvApi,
) -> None:
    doc = await _doc(env_api)
    await env_api.submit()
    await env_api.at_tool()
    await env_api.claim("slow", lease_s=0.05)
    await asyncio.sleep(0.15)  # its lease lapses; the sweep gives the call up (idempotent)
    assert await sweep_lost_calls(env_api.env.store) == ["ep"]
    again = await env_api.claim("fast")
    assert again["claim"] == 2 and again["runner_id"] == "fast"
    before = await dump_all(env_api.redis)
    late = {"claim": 1, "observation_token_ids": [5], "seconds": 1.0}
    for what, body in (("result", late), ("failure", {"claim": 1, "failure": "env_fatal"}),
                       ("heartbeat", {"claim": 1})):  # fmt: skip
        status, error = await env_api.report("ep", "call-1", what, body)
        assert status == 409 and error["error"]["type"] == "claim_lost", (what, error)
        documented(doc, f"{CALL}/{what}", 409, error)
    assert await dump_all(env_api.redis) == before
    # The live claim's result is the one recorded.
    status, after = await env_api.report("ep", "call-1", "result", {**late, "claim": 2})
    assert status == 200 and after["status"] == "next_turn"
    events = await env_api.env.store.events("ep")
    results = [e for e in events if isinstance(e, ToolResultRecorded)]
    assert [(e.claim, e.observation_token_ids.tolist()) for e in results] == [(2, [5])]
    claims = [e.runner_id for e in events if isinstance(e, ToolCallClaimed)]
    assert claims == ["slow", "fast"]
    # A report of a call the episode has not got, under its live claim number: refused too.
    status, _ = await env_api.report("ep", "call-9", "result", {**late, "claim": 2})
    assert status == 409


async def test_env_error_is_retried_within_the_budget_then_fails_the_episode(
    env_api: EnvApi,
) -> None:
    await env_api.submit()
    await env_api.at_tool()
    await env_api.claim("r1")
    fail = {"claim": 1, "failure": "env_error", "error": "sandbox timed out", "seconds": 2.0}
    status, after = await env_api.report("ep", "call-1", "failure", fail)
    assert status == 200 and after["status"] == "awaiting_tool" and after["failure"] is None
    again = await env_api.claim("r2")
    assert again["claim"] == 2
    status, after = await env_api.report("ep", "call-1", "failure", {**fail, "claim": 2})
    assert status == 200 and after["status"] == "failed" and after["failure"] == "env_error"
    assert "sandbox timed out" in after["error"]
    await env_api.claim("r3", 204)


async def test_env_fatal_fails_the_episode_at_once(env_api: EnvApi) -> None:
    await env_api.submit()
    await env_api.at_tool(tool="send")
    claim = await env_api.claim("r1")
    assert claim["name"] == "send" and claim["effect"] == "restart"
    body = {"claim": 1, "failure": "env_fatal", "error": "no such recipient"}
    status, after = await env_api.report("ep", "call-1", "failure", body)
    assert status == 200 and after["status"] == "failed"
    assert after["failure"] == FailureClass.ENV_FATAL.value
    state = await env_api.env.store.head("ep")
    assert state.status is Status.FAILED and state.failure is FailureClass.ENV_FATAL


async def test_a_result_that_spends_a_budget_ends_the_episode(env_api: EnvApi) -> None:
    await env_api.submit(max_total_tokens=5)  # 3 sampled tokens so far
    state = await env_api.at_tool()
    jobs = env_api.jobs(state)
    await env_api.claim("r1")
    body = {"claim": 1, "observation_token_ids": [1, 2], "seconds": 0}
    status, after = await env_api.report("ep", "call-1", "result", body)
    assert status == 200 and after["status"] == "done"
    assert after["finish_reason"] == "max_total_tokens"
    assert env_api.jobs(state) == jobs  # no next turn: no job


async def test_a_waiting_claim_gets_a_call_requested_meanwhile(env_api: EnvApi) -> None:
    await env_api.submit()
    claim = asyncio.create_task(env_api.claim("r1", timeout_s=5))
    await asyncio.sleep(0.2)
    assert not claim.done()
    await env_api.at_tool()
    got = await asyncio.wait_for(claim, 5)
    assert got["call_id"] == "call-1"


async def test_claim_and_reports_in_msgpack(env_api: EnvApi) -> None:
    await env_api.submit()
    await env_api.at_tool()
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    r = await env_api.http.post("/v1/env/box/claim", data=msgpack.packb({"runner_id": "r1"}),
                                headers=headers)  # fmt: skip
    assert r.status == 200 and r.content_type == MSGPACK
    claim = msgpack.unpackb(await r.read())
    ids = np.arange(1000, 1010, dtype=np.int32).tolist()
    body = msgpack.packb({"claim": claim["claim"], "observation_token_ids": ids, "seconds": 0.5})
    r = await env_api.http.post("/v1/env/calls/ep/call-1/result", data=body, headers=headers)
    assert r.status == 200 and msgpack.unpackb(await r.read())["status"] == "next_turn"


async def test_a_runner_of_an_earlier_call_is_fenced_out_of_the_next_one(env_api: EnvApi) -> None:
    # Claim numbers count per call: call-2's first claim is number 1, like call-1's was.
    await env_api.submit()
    await env_api.at_tool()
    await env_api.claim("r1")
    body = {"claim": 1, "observation_token_ids": [900], "seconds": 0.1}
    assert (await env_api.report("ep", "call-1", "result", body))[0] == 200
    store = env_api.env.store
    s = await store.head("ep")
    for e in commands.begin(s, worker_id="w2", weight_version=0, weight_mode="abort",
                            model="test"):  # fmt: skip
        s = await store.append(s, e)
    await store.append_chain(s, episode_commands.request_call(s, name="calc", arguments="{}"))
    second = await env_api.claim("r2")
    assert (second["call_id"], second["claim"]) == ("call-2", 1)
    before = await dump_all(env_api.redis)
    for what, late in (("heartbeat", {"claim": 1}), ("result", body)):
        status, error = await env_api.report("ep", "call-1", what, late)
        assert status == 409 and error["error"]["type"] == "claim_lost", what
    assert await dump_all(env_api.redis) == before
    assert (await env_api.report("ep", "call-2", "heartbeat", {"claim": 1}))[0] == 200


async def test_a_waiting_claim_whose_runner_left_claims_nothing(env_api: EnvApi) -> None:
    # A claim made for nobody would hold the call until its lease lapsed, then count as a
    # lost runner: for a restart tool, the episode would fail for a call that never ran.
    # Served as `rollouts api` serves (web.run_app): a handler is not cancelled when its
    # caller leaves (aiohttp's test server cancels it, which would prove nothing here).
    runner = web.AppRunner(make_app(env_api.client, environment=env_api.env),
                           handler_cancellation=False)  # fmt: skip
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await env_api.submit()
        async with aiohttp.ClientSession() as http:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(f"http://127.0.0.1:{port}/v1/env/box/claim",
                                json={"runner_id": "gone", "timeout_s": 5},
                                timeout=aiohttp.ClientTimeout(total=0.2))  # fmt: skip
        await env_api.at_tool(tool="send")
        await asyncio.sleep(0.3)  # the handler's next looks, had it gone on claiming
        assert (await env_api.env.store.head("ep")).status is Status.AWAITING_TOOL
        claim = await env_api.claim("here")
        assert (claim["runner_id"], claim["claim"]) == ("here", 1)
    finally:
        await runner.cleanup()
