"""``POST /inference/v1/generate`` (vLLM 0.32's token-in/token-out route) and
``POST /skyrl/v1/generate`` (SkyRL's, with its packed ``routed_experts``): one call is one
durable rollout (a group of ``sampling_params.n``), answered whole from its results.

Retries: ``Idempotency-Key``, else the body's ``request_id``, keys the call; else the
``X-Session-ID`` header and the body's hash do (``call.Call.batch_id``).

Overload (``--max-waiting``) and a call outliving the API's wait are answered with a
NON-JSON 503/504 and ``Retry-After``: SkyRL's client retries only a 5xx whose body is not
JSON (or a dropped connection), 30 times; its retry, same body and session, attaches to the
same rollouts. Everything else is answered in vLLM's error body.

``stream: true`` answers server-sent events built from the finished call: per choice one
delta holding every token, then ``data: [DONE]`` (a call is whole when it is answered).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from statemachine import InvalidRequest, RolloutRequest
from store.completions import WaitTimeout

from .. import wire
from ..errors import ApiError, from_validation
from ..route import Route
from . import forms, schemas
from .call import Call, Calls, Overloaded
from .sampling import sampling

_ERRORS = (400, 404, 409, 413, 422, 503, 504)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/inference/v1/generate", "vllm_generate",
          "vLLM's token-in/token-out generate: one durable rollout per sample (n), answered "
          "whole; routed_experts as base64 .npy", schemas.GenerateRequest,
          schemas.GenerateResponse, _ERRORS, harness=True),
    Route("POST", "/skyrl/v1/generate", "skyrl_generate",
          "SkyRL's generate: as /inference/v1/generate, routed_experts packed "
          "{data, shape, dtype} (compact JSON, data first)", schemas.GenerateRequest,
          schemas.SkyrlGenerateResponse, _ERRORS, harness=True),
)  # fmt: skip

SESSION_HEADER = "X-Session-ID"
KEY_HEADER = "Idempotency-Key"


class Handlers:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def vllm_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "vllm_generate", packed=False)

    async def skyrl_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "skyrl_generate", packed=True)

    async def _generate(self, request: web.Request, route: str, *,
                        packed: bool) -> web.StreamResponse:  # fmt: skip
        raw = await request.read()
        data = wire.decode_body(raw, request.headers.get("Content-Type", ""))
        try:
            body = schemas.GenerateRequest.model_validate(data)
        except ValidationError as exc:
            raise from_validation(exc) from None
        served = self.calls.served
        unknown = served.unknown(body.model)
        if unknown is not None:
            raise ApiError(404, "NotFoundError", unknown, "model")
        asked = sampling(body.sampling_params, len(body.token_ids),
                         max_model_len=served.max_model_len)  # fmt: skip
        try:
            rollout = RolloutRequest(prompt_token_ids=tuple(body.token_ids), sampling=asked.params)
        except InvalidRequest as exc:
            raise ApiError(422, "invalid_request", str(exc), "token_ids") from None
        key = request.headers.get(KEY_HEADER) or body.request_id
        call = Call(route=route, request=rollout, n=asked.n, key=key,
                    session=request.headers.get(SESSION_HEADER) or None, body=raw)  # fmt: skip
        try:
            results = await self.calls.run(call, gone=_gone(request))
        except Overloaded as exc:
            return retry_later(503, str(exc), 1)
        except WaitTimeout as exc:
            # Its rollouts go on; the client's retry (same key, or same session and body)
            # attaches to them.
            return retry_later(504, f"the call is still generating ({exc}); retry", 1)
        answer = forms.response(
            results,
            request_id=body.request_id or key or call.batch_id(),
            model=body.model or served.name,
            sampling=asked,
            prompt=body.token_ids,
            return_token_ids=bool(body.return_token_ids),
            packed_routes=packed,
            created=int(time.time()),
        )
        if body.stream:
            return web.Response(body=forms.sse(forms.stream_chunks(answer)),
                                content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})  # fmt: skip
        return web.Response(body=forms.compact_json(answer), content_type=wire.JSON)


def retry_later(status: int, message: str, after_s: int) -> web.Response:
    """A 5xx SkyRL's client retries: plain text, not JSON (a JSON 5xx it raises at once)."""
    return web.Response(status=status, text=f"{message}\n", content_type="text/plain",
                        headers={"Retry-After": str(after_s)})  # fmt: skip


def _gone(request: web.Request) -> Any:
    transport = request.transport

    def gone() -> bool:
        return transport is None or transport.is_closing()

    return gone


__all__ = ["ROUTES", "Handlers"]
