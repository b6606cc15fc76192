"""What harness clients call around generation: ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health``, and SkyRL's control plane mapped onto ours where it has a
meaning (``/pause``, ``/resume``, ``/update_weights``, ``/get_world_size``, ``/is_sleeping``).
The other control paths of vLLM and SkyRL (``UNSERVED``) answer 404 saying so (``app``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from store import sessions
from store.pause import Pause, PauseFlag

from .. import wire
from ..errors import ApiError, from_validation
from ..route import Route
from . import schemas
from .call import Calls

# Without a tokenizer these are not mounted (nor documented): a call to them is refused by the
# app with 422 no_tokenizer (``Route.needs_tokenizer``).
_NEEDS = "needs the model's tokenizer: start rollouts api with --tokenizer DIR"
ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/models", "models", "The served model: its name and max_model_len",
          response=schemas.ModelList, harness=True),
    Route("POST", "/tokenize", "tokenize", "Text -> token ids (needs rollouts api --tokenizer)",
          schemas.TokenizeRequest, schemas.TokenizeResponse, (400, 404, 413, 422),
          harness=True, needs_tokenizer=("prompt", _NEEDS)),
    Route("POST", "/detokenize", "detokenize",
          "Token ids -> text (needs rollouts api --tokenizer)", schemas.DetokenizeRequest,
          schemas.DetokenizeResponse, (400, 404, 413, 422), harness=True,
          needs_tokenizer=("tokens", _NEEDS)),
    Route("GET", "/health", "health", "200 while Redis answers (vLLM's /health)",
          response=schemas.ControlAnswer, errors=(503,), harness=True),
    Route("POST", "/pause", "pause",
          "Workers take no new rollout until /resume (SkyRL's and vLLM's pause). keep: running "
          "rollouts go on; abort: they are aborted with their progress kept and resume after "
          "/resume; wait: as keep, and the call answers once none runs (or a 504 after "
          "timeout seconds, saying how many still run)",
          response=schemas.ControlAnswer, errors=(422, 503, 504), query=schemas.PauseQuery,
          harness=True),
    Route("POST", "/resume", "resume", "Workers admit rollouts again",
          response=schemas.ControlAnswer, errors=(503,), harness=True),
    Route("POST", "/update_weights", "update_weights",
          "Publish the next weight version (latest + 1) at weight_dir (prime-rl's form)",
          schemas.UpdateWeightsRequest, schemas.ControlAnswer, (400, 409, 413, 422, 503),
          harness=True),
    Route("POST", "/finish_session", "finish_session",
          "A session's trajectory ended (SkyRL): its calls stop preferring the worker that "
          "served them; the calls themselves stay until acknowledged",
          response=schemas.SessionFinished, errors=(422, 503),
          query=schemas.FinishSessionQuery, harness=True),
    Route("GET", "/get_world_size", "get_world_size",
          "1: this API is one server; weights travel by path, never by collective",
          response=schemas.WorldSize, harness=True),
    Route("GET", "/is_sleeping", "is_sleeping", "Always false: nothing here sleeps",
          response=schemas.Sleeping, harness=True),
)  # fmt: skip

# vLLM's and SkyRL's other control paths: answered 404 with a body that says durable-rollouts
# does not serve them (a harness calling one learns why, not merely "Not Found").
UNSERVED = frozenset({
    "/sleep", "/wake_up", "/reset_prefix_cache", "/reset_mm_cache", "/collective_rpc",
    "/init_weight_transfer", "/init_weight_transfer_engine", "/init_weight_update_communicator",
    "/start_weight_update", "/finish_weight_update", "/update_weights_ipc",
    "/update_weights_nccl", "/update_named_weights", "/get_server_info", "/server_info",
    "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/is_paused", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/v1/render", "/inference/v1/render",
})  # fmt: skip
HEALTH_TIMEOUT_S = 2.0
# How often /pause?mode=wait reads the workers' beats (one round trip): each worker beats every
# heartbeat_s (1 s by default), so a faster look would see nothing new.
IDLE_POLL_S = 0.1


def unserved(path: str) -> ApiError | None:
    """The 404 for a control path of vLLM/SkyRL we do not serve, or None for any other."""
    if path not in UNSERVED:
        return None
    return ApiError(
        404, "not_served",
        f"durable-rollouts does not serve {path}: its harness routes are /inference/v1/generate, "
        "/skyrl/v1/generate, /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health, /pause, /resume, /finish_session, /update_weights, /get_world_size, "
        "/is_sleeping",
    )  # fmt: skip


class Handlers:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.client = calls.client
        self.pause_flag = PauseFlag(calls.client.redis, calls.client.keys)
        self.started = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        served = self.calls.served
        card = {"id": served.name, "object": "model", "created": self.started,
                "owned_by": "durable-rollouts", "root": served.name, "parent": None,
                "max_model_len": served.max_model_len}  # fmt: skip
        return _json({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, schemas.TokenizeRequest)
        tok = self._tokenizer("/tokenize", body.model)
        ids = tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return _json({"count": len(ids), "max_model_len": self.calls.served.max_model_len,
                      "tokens": [int(t) for t in ids]})  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, schemas.DetokenizeRequest)
        tok = self._tokenizer("/detokenize", body.model)
        return _json({"prompt": tok.decode(body.tokens)})

    async def health(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.client.redis.ping(), HEALTH_TIMEOUT_S)  # type: ignore[arg-type]
        except Exception as exc:
            raise ApiError(503, "unavailable", f"Redis does not answer: {type(exc).__name__}",
                           retry_after_s=1) from None  # fmt: skip
        return _json(await self._state())

    async def pause(self, request: web.Request) -> web.Response:
        try:
            query = schemas.PauseQuery.model_validate(dict(request.query))
        except ValidationError as exc:
            raise from_validation(exc) from None
        paused = await self.pause_flag.pause(query.mode)
        if query.mode != "wait":
            return _json(await self._state())
        running = await self._until_idle(paused, query.timeout)
        return _json({**await self._state(), "running": running})

    async def finish_session(self, request: web.Request) -> web.Response:
        try:
            query = schemas.FinishSessionQuery.model_validate(dict(request.query))
        except ValidationError as exc:
            raise from_validation(exc) from None
        released = await sessions.release(self.client.redis, self.client.keys, query.session_id)
        # Its episode ends once its last turn has (``session_end``): nothing more will come.
        await self.calls.turns.finish(query.session_id)
        return _json({"session_id": query.session_id, "released": released})

    async def resume(self, request: web.Request) -> web.Response:
        await self.pause_flag.resume()
        return _json(await self._state())

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _parse(request, schemas.UpdateWeightsRequest)
        latest = await self.client.weights.latest()
        published = await self.client.publish_weights(
            (latest.version if latest else 0) + 1, body.weight_dir
        )
        return _json({**await self._state(), "weight_version": published.version})

    async def get_world_size(self, request: web.Request) -> web.Response:
        return _json({"world_size": 1})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": False})

    def _tokenizer(self, path: str, model: str | None) -> Any:
        unknown = self.calls.served.unknown(model)
        if unknown is not None:
            raise ApiError(404, "NotFoundError", unknown, "model")
        tok = self.client.tokenizer
        if tok is None:
            raise ApiError(400, "no_tokenizer",
                           f"{path} needs the model's tokenizer: start rollouts api with "
                           "--tokenizer DIR", None)  # fmt: skip
        return tok

    async def _until_idle(self, paused: Pause, timeout: float | None) -> int:
        """Until no rollout runs anywhere (0), or the pause was lifted meanwhile (the rollouts
        then running); a 504 after ``timeout`` seconds. Idle needs both views: the store's
        (no rollout generating or resumed, counted in the same step as each transition) and
        every live worker's own beat (it holds the pause, so takes nothing new, and ran
        nothing when it beat after seeing it). A worker too old to say it holds a pause is
        never idle, and the timeout's answer names it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            stats = await self.client.stats()
            running = stats.in_flight
            unaware = [w.worker_id for w in stats.workers if w.paused is None]
            if await self.pause_flag.current() is None:
                return running  # /resume came first: nothing to wait for any more
            if not unaware and running == 0 and not any(w.in_flight for w in stats.workers):
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                raise ApiError(
                    504, "still_running",
                    f"the deployment is paused (mode {paused.mode}) but {running} rollouts "
                    f"still run after {timeout:g} s"
                    + (f"; {len(unaware)} workers have not seen the pause yet "
                       f"({', '.join(unaware[:5])})" if unaware else "")
                    + ": call /pause?mode=wait again to wait on, or /resume",
                )  # fmt: skip
            await asyncio.sleep(IDLE_POLL_S)

    async def _state(self) -> dict[str, Any]:
        now = await self.pause_flag.current()
        return {"status": "ok", "paused": now is not None,
                "mode": now.mode if now is not None else None,
                "since": now.at if now is not None else None}  # fmt: skip


async def _parse(request: web.Request, model: type[Any]) -> Any:
    data = wire.decode_body(await request.read(), request.headers.get("Content-Type", ""))
    try:
        out: BaseModel = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None
    return out


def _json(body: Any) -> web.Response:
    return web.Response(body=wire.encode(body, False), content_type=wire.JSON)
