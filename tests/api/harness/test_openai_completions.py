"""``POST /v1/completions`` through the real ``openai`` package (``AsyncOpenAI`` and
``OpenAI``) against a real ``rollouts api`` process and a real worker on the CPU engine: each
call one durable rollout (a group for ``n``), its greedy answer the same as the trainer API's
run of the same prompt."""

from __future__ import annotations

import numpy as np
import pytest
from openai import AsyncOpenAI, OpenAI
from transformers import AutoTokenizer

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.harness.conftest import Api

pytestmark = pytest.mark.slow  # processes start and the CPU engine generates (~10 s)
PROMPT = [74, 289, 78, 81, 265, 273, 352]


async def reference(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """The same prompt through the trainer API, greedy: an uninterrupted run's answer."""
    client = RolloutClient(url)
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        batch = await client.submit([RolloutRequest(prompt_token_ids=tuple(prompt),
                                                    sampling=sampling)])  # fmt: skip
        [r] = await client.wait(list(batch), timeout=120)
        return r.response_token_ids.tolist(), r.logprobs
    finally:
        await client.aclose()


async def test_token_prompt_greedy_with_token_ids_as_the_benchmark_calls(
    api: Api, harness_redis: RedisServer
) -> None:
    oai = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0)
    out = await oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    [choice] = out.choices
    ids, _ = await reference(harness_redis.url, PROMPT, 32)
    assert choice.token_ids == ids  # type: ignore[attr-defined]
    assert choice.prompt_token_ids == PROMPT  # type: ignore[attr-defined]
    assert out.model == "tiny" and out.object == "text_completion"
    tok = AutoTokenizer.from_pretrained(api_tokenizer(api))
    assert choice.text == tok.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length")
    assert choice.finish_reason == ("length" if len(ids) == 32 else "stop")
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), len(ids))
    assert out.usage.total_tokens == len(PROMPT) + len(ids)
    await oai.close()


def api_tokenizer(api: Api) -> str:
    args = api.proc.args
    assert isinstance(args, list)
    return str(args[args.index("--tokenizer") + 1])


async def test_without_a_tokenizer_token_ids_in_and_out_and_an_empty_text(
    bare_api: Api, harness_redis: RedisServer
) -> None:
    oai = AsyncOpenAI(base_url=bare_api.v1, api_key="unused", max_retries=0)
    prompt = [5, 6, 7, 8]
    out = await oai.completions.create(
        model="m", prompt=prompt, max_tokens=12, temperature=0,
        logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    [choice] = out.choices
    ref_ids, ref_lps = await reference(harness_redis.url, prompt, 12)
    assert choice.text == ""
    assert choice.token_ids == ref_ids  # type: ignore[attr-defined]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    # No tokenizer: tokens as "token_id:<id>" (vLLM would fail the call).
    assert lp.tokens == [f"token_id:{t}" for t in ref_ids]
    np.testing.assert_allclose(lp.token_logprobs, ref_lps, rtol=0, atol=1e-6)
    pairs = zip(ref_ids, lp.token_logprobs, strict=True)
    assert lp.top_logprobs == [{f"token_id:{t}": v} for t, v in pairs]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(ref_ids))]
    await oai.close()


async def test_text_prompt_is_the_tokenizers_ids_and_the_sync_client_works(api: Api) -> None:
    tok = AutoTokenizer.from_pretrained(api_tokenizer(api))
    text = "Hello world, how are you"
    oai = OpenAI(base_url=api.v1, api_key="unused", max_retries=0)
    by_text = oai.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})  # fmt: skip
    ids = tok.encode(text)
    by_ids = oai.completions.create(model="tiny", prompt=[ids], max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})  # fmt: skip
    assert by_text.choices[0].prompt_token_ids == ids  # type: ignore[attr-defined]
    assert by_text.choices[0].token_ids == by_ids.choices[0].token_ids  # type: ignore[attr-defined]
    assert by_text.choices[0].text == by_ids.choices[0].text
    oai.close()


async def test_n_samples_are_one_group_and_stop_strings_and_ids_end_a_choice(
    api: Api, harness_redis: RedisServer
) -> None:
    oai = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0)
    out = await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, n=3,
                                       temperature=1.0, seed=7,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    # One batch of one group of three rollouts, whose id the answer carries.
    trainer = RolloutClient(harness_redis.url)
    batch_id = out.id.removeprefix("cmpl-")
    info = await trainer.batch(batch_id)
    assert (info.groups, info.group_size) == (1, 3)
    results = await trainer.wait(info.ids, timeout=60)
    assert [r.response_token_ids.tolist() for r in results] == [
        c.token_ids
        for c in out.choices  # type: ignore[attr-defined]
    ]
    assert {r.group_id for r in results} == {results[0].group_id}
    # A stop token id: the greedy answer ends at its first occurrence, finish "stop".
    ids, _ = await reference(harness_redis.url, PROMPT, 16)
    stop_id = ids[3]
    cut = await oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True,
                                                   "stop_token_ids": [stop_id]})  # fmt: skip
    [c] = cut.choices
    assert c.token_ids == ids[: ids.index(stop_id) + 1]  # type: ignore[attr-defined]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)  # type: ignore[attr-defined]
    await trainer.aclose()
    await oai.close()
