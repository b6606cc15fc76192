"""``POST /v1/chat/completions`` through the real ``openai`` package against a real
``rollouts api --tokenizer`` process and a real CPU worker: the prompt is the tokenizer's chat
template of the messages, the answer the greedy run's, with vLLM's extensions."""

from __future__ import annotations

import numpy as np
import pytest
from openai import AsyncOpenAI, UnprocessableEntityError
from transformers import AutoTokenizer

from store.redis_server import RedisServer
from tests.api.harness.conftest import Api
from tests.api.harness.test_openai_completions import api_tokenizer, reference

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


async def test_chat_prompt_is_the_template_and_the_answer_the_greedy_run(
    api: Api, harness_redis: RedisServer
) -> None:
    tok = AutoTokenizer.from_pretrained(api_tokenizer(api))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt  # a BatchEncoding
    oai = AsyncOpenAI(base_url=api.v1, api_key="unused", max_retries=0)
    out = await oai.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=10, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=0,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    ids, lps = await reference(harness_redis.url, list(prompt), 10)
    assert out.object == "chat.completion" and out.model == "tiny"
    assert out.prompt_token_ids == list(prompt)  # type: ignore[attr-defined]
    [choice] = out.choices
    assert choice.token_ids == ids  # type: ignore[attr-defined]
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [c.token for c in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], lps, atol=1e-6)
    assert all(c.top_logprobs == [] for c in choice.logprobs.content)
    assert out.usage is not None and out.usage.completion_tokens == len(ids)
    # Decoded tokens when not asked for ids: the tokenizer's string of each token.
    plain = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,  # type: ignore[arg-type]
                                              temperature=0, logprobs=True)  # fmt: skip
    assert plain.choices[0].logprobs is not None
    tokens = [c.token for c in plain.choices[0].logprobs.content or []]
    assert tokens == [tok.decode([t]) for t in ids]
    await oai.close()


async def test_chat_needs_a_tokenizer(bare_api: Api) -> None:
    oai = AsyncOpenAI(base_url=bare_api.v1, api_key="unused", max_retries=0)
    with pytest.raises(UnprocessableEntityError) as info:
        await oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert info.value.body["param"] == "messages"  # type: ignore[index]
    assert "--tokenizer" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(UnprocessableEntityError) as info:
        await oai.completions.create(model="m", prompt="some text", max_tokens=4)
    assert info.value.body["param"] == "prompt"  # type: ignore[index]
    await oai.close()
