"""The ``openai`` client's own retries against ``rollouts api``: a 429 over ``--max-waiting``
(Retry-After honoured) then the answer; a call whose attempts time out retried with the same
body attaches to the same rollouts (one recorded, not one per attempt) when it carries a
session or an Idempotency-Key; the same key with another body is a 409 it does not retry."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, ConflictError

from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.conftest import Api, StartApi

pytestmark = pytest.mark.slow
LONG = {"return_token_ids": True, "ignore_eos": True}


def recording(statuses: list[int], sent: list[str] | None = None) -> httpx.AsyncClient:
    async def on_response(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    async def on_request(request: httpx.Request) -> None:
        if sent is not None:
            sent.append(request.url.path)

    return httpx.AsyncClient(event_hooks={"response": [on_response], "request": [on_request]})


async def test_429_over_max_waiting_is_retried_by_the_client(
    start_api: StartApi, cpu_worker: object, harness_redis: RedisServer
) -> None:
    api = start_api("--max-waiting", "1")
    # The first call holds the one place: its rollout is recorded (seen in its session) before
    # the second call is sent, and 2,000 tokens take seconds on the CPU engine, so the second's
    # first attempt finds the place taken (a fixed sleep did not: under load the first call
    # had not arrived, or had already ended).
    first = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0)
    in_flight = asyncio.ensure_future(first.completions.create(
        model="m", prompt=[9, 10, 11], max_tokens=2000, temperature=0,
        extra_body={**LONG, "session_id": "s-429"}))  # fmt: skip
    trainer = RolloutClient(harness_redis.url)
    try:
        while not await trainer.session("s-429"):
            assert not in_flight.done(), in_flight.result()
            await asyncio.sleep(0.02)
    finally:
        await trainer.aclose()
    statuses: list[int] = []
    second = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=30,
                         http_client=recording(statuses))  # fmt: skip
    out = await second.completions.create(
        model="m", prompt=[12, 13], max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert statuses[0] == 429 and statuses[-1] == 200, statuses
    assert len(out.choices[0].token_ids) == 4  # type: ignore[attr-defined]
    assert len((await in_flight).choices[0].token_ids) == 2000  # type: ignore[attr-defined]
    await first.close()
    await second.close()


@pytest.mark.parametrize("keyed_by", ["session", "idempotency-key", "none"])
async def test_attempts_that_time_out_attach_to_one_rollout(
    api: Api, harness_redis: RedisServer, keyed_by: str
) -> None:
    """Each attempt gives up after 0.3 s, before the rollout (400 tokens) ends; the client
    retries the same body. Keyed (session, Idempotency-Key): one rollout, the answer of the
    attempt that outlives it. Unkeyed: every attempt is a new call, as the README says."""
    extra_headers = {"Idempotency-Key": f"k-{keyed_by}"} if keyed_by == "idempotency-key" else {}
    body = {**LONG, "session_id": "s-retry"} if keyed_by == "session" else dict(LONG)
    trainer = RolloutClient(harness_redis.url)
    before = set(await trainer.batches())
    statuses: list[int] = []
    sent: list[str] = []
    oai = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=6, timeout=0.3,
                      http_client=recording(statuses, sent))  # fmt: skip
    prompt = [21, 22, 23, len(keyed_by)]
    try:
        out = await oai.completions.create(model="m", prompt=prompt, max_tokens=400,
                                           temperature=0, extra_body=body,
                                           extra_headers=extra_headers)  # fmt: skip
    except Exception:  # unkeyed: every attempt starts over and times out
        assert keyed_by == "none"
        out = None
    new = set(await trainer.batches()) - before
    assert len(sent) > 1  # attempts timed out and were retried
    if keyed_by == "none":
        assert len(new) == len(sent)  # one call, and one recorded rollout, per attempt
        for b in new:  # not left to load the worker under the next tests
            await trainer.cancel(batch_id=b, reason="test over")
    else:
        assert out is not None and len(out.choices[0].token_ids) == 400  # type: ignore[attr-defined]
        assert new == {out.id.removeprefix("cmpl-")}
    await oai.close()
    await trainer.aclose()


async def test_same_key_other_body_is_a_409_not_retried(api: Api) -> None:
    statuses: list[int] = []
    oai = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=2,
                      http_client=recording(statuses))  # fmt: skip
    headers = {"Idempotency-Key": "k-conflict"}
    first = await oai.completions.create(model="m", prompt=[31, 32], max_tokens=3, temperature=0,
                                         extra_headers=headers)  # fmt: skip
    again = await oai.completions.create(model="m", prompt=[31, 32], max_tokens=3, temperature=0,
                                         extra_headers=headers)  # fmt: skip
    assert again.id == first.id and again.choices[0].text == first.choices[0].text
    statuses.clear()
    with pytest.raises(ConflictError):
        await oai.completions.create(model="m", prompt=[31, 33], max_tokens=3, temperature=0,
                                     extra_headers=headers)  # fmt: skip
    assert statuses == [409]  # x-should-retry: false
    await oai.close()
