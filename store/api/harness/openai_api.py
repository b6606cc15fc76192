"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's API with the vLLM
extensions RL harnesses use, each call one durable rollout (a group of ``n`` for ``n``).

A call is checked (``openai_schemas``), turned into one ``RolloutRequest`` (a text prompt or
chat messages through the API's ``--tokenizer``), run by ``Calls`` (one batch under the
call's key: ``Idempotency-Key`` header, else ``request_id``, else the session and a hash of
the body) and answered in vLLM's form (``openai_views``). Without ``--tokenizer`` a prompt
must be token ids, the answer's ``text`` is ``""`` and logprob tokens are ``token_id:<id>``.
Chat ``tools`` are rendered by the template and the answer parsed for calls where the
template renders tools (``chat_tools``, ``tool_parser``).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from statemachine import InvalidRequest, RolloutRequest, SamplingParams
from store import defaults
from store.results import RolloutResult

from .. import wire
from ..errors import ApiError, from_validation
from ..route import Route
from . import chat_tools
from . import openai_schemas as s
from . import openai_views as views
from .call import Call, Calls

_ERRORS = (400, 409, 413, 422, 429, 504)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/completions", "completions",
          "OpenAI/vLLM completion of one prompt (token ids, or text with --tokenizer); n "
          "samples are a group of n rollouts; a retry under the same key attaches",
          s.CompletionRequest, s.CompletionResponse, _ERRORS, harness=True,
          tokens_body=s.CompletionTokensRequest),
    Route("POST", "/v1/chat/completions", "chat_completions",
          "OpenAI/vLLM chat completion (needs --tokenizer: its chat template); n samples are "
          "a group of n rollouts; a retry under the same key attaches",
          s.ChatCompletionRequest, s.ChatCompletionResponse, _ERRORS, harness=True,
          needs_tokenizer=("messages", "chat needs an API started with --tokenizer (its chat "
                                       "template)"),
          no_tools_body=s.ChatCompletionNoToolsRequest),
)  # fmt: skip

# Why each feature vLLM has is refused (its neutral value is accepted: see openai_schemas).
_NO = "durable-rollouts does not serve "
REFUSED: dict[str, str] = {
    "stream": _NO + "streaming: call with stream false (the answer comes whole)",
    "stream_options": _NO + "streaming",
    "echo": _NO + "echo (the prompt's logprobs are not computed)",
    "prompt_logprobs": _NO + "prompt logprobs",
    "best_of": _NO + "best_of > 1: ask n samples",
    "suffix": _NO + "suffix (no insertion)",
    "logit_bias": _NO + "logit_bias",
    "presence_penalty": _NO + "presence_penalty (only 0)",
    "frequency_penalty": _NO + "frequency_penalty (only 0)",
    "repetition_penalty": _NO + "repetition_penalty (only 1)",
    "min_p": _NO + "min_p (only 0)",
    "response_format": _NO + "structured output (response_format)",
    "structured_outputs": _NO + "structured output",
    "use_beam_search": _NO + "beam search",
    "include_stop_str_in_output": _NO + "include_stop_str_in_output (only false)",
    "skip_special_tokens": _NO + "skip_special_tokens false (text skips special tokens)",
    "spaces_between_special_tokens": _NO + "spaces_between_special_tokens false",
    "allowed_token_ids": _NO + "allowed_token_ids",
    "bad_words": _NO + "bad_words",
    "logprob_token_ids": _NO + "logprob_token_ids",
    "truncate_prompt_tokens": _NO + "prompt truncation",
    "priority": _NO + "priorities (only 0)",
    "cache_salt": _NO + "cache_salt",
    "kv_transfer_params": _NO + "KV transfer",
    "vllm_xargs": _NO + "vllm_xargs",
    "tool_choice": _NO + 'tool_choice "required" or a named function (each needs guided '
    'decoding to be kept): "auto" or "none"',
    "reasoning_effort": _NO + "reasoning_effort",
    "continue_final_message": _NO + "continue_final_message",
    "add_special_tokens": _NO + "add_special_tokens true in chat (the template has them)",
    "documents": _NO + "documents",
    "chat_template": _NO + "a per-call chat template (the API's --tokenizer has one)",
}
# "prompts[0]: sampling.max_tokens must be ..." (the client's refusal) -> "max_tokens"
_SAMPLING_FIELD = re.compile(r"^(?:prompts\[\d+\]: )?(?:sampling\.)?([a-z_]+)")


def _validate(model: type[s._Sampling], data: Any) -> Any:
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], list | str):
        raise ApiError(422, "unsupported_field", "prompt: one prompt per call (n samples of "
                       "it with n); send each prompt in a call of its own", "prompt")  # fmt: skip
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        for e in errors:
            name = e["loc"][0] if e["loc"] else None
            if isinstance(name, str) and name in REFUSED:
                raise ApiError(422, "unsupported_field", f"{name}: {REFUSED[name]}",
                               name) from None  # fmt: skip
        error = from_validation(exc)
        # A union's branch names its validators in the location: the field is what precedes.
        parts = [str(p) for p in errors[0]["loc"]]
        kept = list(itertools.takewhile(_PLAIN.fullmatch, parts))
        error.field = ".".join(kept) or None
        if kept != parts:
            error.message = f"{error.field}: {errors[0]['msg']}"
        raise error from None


_PLAIN = re.compile(r"[A-Za-z_0-9]+")


def _sampling(body: s._Sampling, max_tokens: int | None, logprobs: int) -> SamplingParams:
    stop = body.stop if body.stop is not None else ()
    try:
        return SamplingParams(
            # null: what the context leaves (vLLM's default); the worker caps it to the model's.
            max_tokens=max_tokens if max_tokens is not None else defaults.MAX_TOKENS_CAP,
            cap_to_context=max_tokens is None,
            min_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except InvalidRequest as exc:
        raise _refused(exc) from None


def _refused(exc: InvalidRequest, renames: dict[str, str] | None = None) -> ApiError:
    m = _SAMPLING_FIELD.match(str(exc))
    name = m.group(1) if m else None
    if name is not None and renames:
        name = renames.get(name, name)
    return ApiError(422, "invalid_request", str(exc), name)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class Handlers:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.tokenizer: Any = calls.client.tokenizer  # a transformers tokenizer, or None
        # Checked once: the template is the API's for its lifetime.
        self.tools = self.tokenizer is not None and chat_tools.renders_tools(self.tokenizer)

    async def _read(self, request: web.Request, model: type[s._Sampling]) -> tuple[bytes, Any]:
        raw = await request.read()
        data = wire.decode_body(raw, request.headers.get("Content-Type", ""))
        return raw, _validate(model, data)

    async def _run(
        self, request: web.Request, route: str, raw: bytes, body: s._Sampling,
        prompt: list[int], sampling: SamplingParams, renames: dict[str, str],
    ) -> tuple[str, list[Any]]:  # fmt: skip
        session = body.session_id or request.headers.get("X-Session-ID") or None
        key = request.headers.get("Idempotency-Key") or body.request_id
        try:
            rollout = RolloutRequest(prompt_token_ids=tuple(prompt), sampling=sampling)
        except InvalidRequest as exc:
            raise _refused(exc, renames) from None
        call = Call(route=route, request=rollout, n=body.n, key=key, session=session, body=raw)
        try:
            results = await self.calls.run(call, gone=lambda: _gone(request))
        except InvalidRequest as exc:  # the client's own checks (e.g. top-k not recorded)
            raise _refused(exc, renames) from None
        return results[0].batch_id, results  # the answer's id names the call's batch

    def _text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(422, "no_tokenizer", "prompt: a text prompt needs an API started "
                           "with --tokenizer; this one takes token ids", "prompt")  # fmt: skip
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    async def completions(self, request: web.Request) -> web.Response:
        raw, body = await self._read(request, s.CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # one prompt, as a list of one (the schema allows no more)
        if isinstance(prompt, str):
            prompt = self._text_ids(prompt, body.add_special_tokens)
        sampling = _sampling(body, body.max_tokens, body.logprobs or 0)
        call_id, results = await self._run(request, "completions", raw, body, prompt, sampling,
                                           {})  # fmt: skip
        show = views.Tokens(self.tokenizer, bool(body.return_tokens_as_token_ids))
        out = views.completion(results, call_id=call_id, model=body.model or "default",
                               logprobs=body.logprobs, token_ids=bool(body.return_token_ids),
                               show=show)  # fmt: skip
        return _reply(out)

    async def chat_completions(self, request: web.Request) -> web.Response:
        # Served only with a tokenizer: without one the route is not mounted, and a call to it
        # is refused by the app (``Route.needs_tokenizer``).
        raw, body = await self._read(request, s.ChatCompletionRequest)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(422, "invalid_request", "top_logprobs: needs logprobs true",
                           "top_logprobs")  # fmt: skip
        tool_choice = chat_tools.choice(body, self.tools)
        prompt = chat_tools.prompt_ids(self.tokenizer, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        sampling = _sampling(body, max_tokens, top or 0)
        renames = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"
                   if body.max_completion_tokens else "max_tokens"}  # fmt: skip
        call_id, results = await self._run(request, "chat_completions", raw, body, prompt,
                                           sampling, renames)  # fmt: skip
        show = views.Tokens(self.tokenizer, bool(body.return_tokens_as_token_ids))

        def message(r: RolloutResult) -> tuple[dict[str, Any], bool]:
            return chat_tools.message(r, self.tokenizer, tool_choice, body.parallel_tool_calls)

        out = views.chat(
            results,
            call_id=call_id,
            model=body.model or "default",
            top_logprobs=top,
            token_ids=bool(body.return_token_ids),
            show=show,
            message=message,
        )
        return _reply(out)


def _reply(body: dict[str, Any]) -> web.Response:
    return web.Response(body=wire.encode(body, False), content_type=wire.JSON)
