"""One endpoint of the HTTP API as data: the routes table (``app.ROUTES``) is made of these,
and ``openapi`` documents them. Apart from ``app`` so that ``openapi`` can read them without
importing the application that serves its document."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: what it does, and what ``/openapi.json`` says of it."""

    method: str
    path: str
    name: str  # the ``Handlers`` method, and the operationId
    summary: str
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    query: type[BaseModel] | None = None
    stream: bool = False  # NDJSON (or a msgpack sequence) of ``response`` | StreamError
    text: bool = False  # text/plain (Prometheus exposition)
    # What a 204 (no body) means, for a route that may answer one (a claim that found nothing).
    empty: str | None = None
    # An endpoint a harness calls (``store.api.harness``): served by the harness handlers, its
    # errors in the OpenAI/vLLM body ``{"error": {"message", "type", "param", "code"}}``.
    harness: bool = False
    # What an API started without --tokenizer serves (``app.tokens_only``): ``tokens_body``, the
    # body it takes instead (prompts as token ids only: it cannot tokenize text nor apply a
    # chat template), documented in ``body``'s place; ``needs_tokenizer``, (field, why) of a
    # route it cannot serve at all: neither mounted nor documented, a call to its path answered
    # 422 ``no_tokenizer`` naming the field.
    tokens_body: type[BaseModel] | None = None
    needs_tokenizer: tuple[str, str] | None = None
    # The body an API whose chat template renders no tools serves and documents instead
    # (``app.without_tools``): the same without ``tools`` (store/api/harness/chat_tools.py).
    no_tools_body: type[BaseModel] | None = None
