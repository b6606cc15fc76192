"""The contract of ``/v1/completions`` and ``/v1/chat/completions`` as the served
``/openapi.json`` states it: the requests the tests send are valid by it, and every answer
(success and refusal, in OpenAI's error body) is one it declares."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import jsonschema
import pytest

from tests.api.harness.conftest import Api
from tests.api.test_openapi import check_response

pytestmark = pytest.mark.slow
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                         "logprobs": 0, "return_token_ids": True, "n": 2}),
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "stop": ["zz"], "seed": 3}),
    ("/v1/completions", {"prompt": [5], "max_tokens": 2, "echo": True}),  # refused
    ("/v1/completions", {"prompt": [], "max_tokens": 2}),  # refused
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "logprobs": True, "top_logprobs": 0, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}),  # refused
    # A well-formed tool, refused by an API whose template (ChatML here) renders none: its
    # document's chat body has no tools.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),
]  # fmt: skip


async def test_requests_and_answers_as_the_document_says(api: Api) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api.base}/openapi.json") as r:
            doc = await r.json()
        for path, body in CASES:
            op = doc["paths"][path]["post"]
            assert op["responses"]["500"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OpenAIErrorBody"}  # fmt: skip
            schema = {**op["requestBody"]["content"]["application/json"]["schema"],
                      "components": doc["components"]}  # fmt: skip
            valid = jsonschema.Draft202012Validator(schema).is_valid(body)
            async with http.post(f"{api.base}{path}", json=body) as r:
                status, ctype, raw = r.status, r.content_type, await r.read()
            # The document accepts exactly what the handler serves.
            assert valid == (status == 200), (path, body, status, raw[:300])
            check_response(doc, op, status, ctype, raw, f"{path} {json.dumps(body)}")
            if status != 200:
                assert json.loads(raw)["error"]["param"] is not None
