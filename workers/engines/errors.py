"""Errors raised by engines: one base, `EngineError`, itself a `workers.errors.WorkerError`,
so `except WorkerError` still catches everything the worker package raises."""

from __future__ import annotations

from workers.errors import WorkerError


class EngineError(WorkerError):
    """An engine failed to serve a request (bad input, a failed forward, a closed engine)."""


class RequestRejected(EngineError):
    """The engine can never serve this request as asked (a prompt as long as the context,
    token ids outside the vocabulary, a token budget beyond the context, sampling values it
    refuses): no retry on any worker of this model would help, so the worker fails the rollout
    at once with ``FailureClass.REQUEST_ERROR`` instead of spending its engine-error budget."""


class RequestAborted(EngineError):
    """The request was aborted: its stream ends with this instead of a finish reason.

    Raised by `Engine.generate` iterators whose request was aborted, so that a stream which
    ends without raising always carried a finish reason on its last chunk.
    """


class EngineClosed(EngineError):
    """The engine was closed; it serves no new request and no weight load."""


class WeightLoadError(EngineError):
    """A checkpoint could not be loaded; the engine keeps its previous weights and version."""


class EngineUnavailable(EngineError):
    """No healthy vLLM server could take the request, or retries ran out (vllm-http)."""


class WireFormatError(EngineError):
    """A vLLM server answered with something malformed (e.g. routed experts whose shape,
    byte count or dtype do not agree); the answer is refused, never half-used."""


class EngineDead(EngineError):
    """The engine's core (its process) died: nothing it held can finish here, and no later
    call will work. The worker stops and its rollouts resume elsewhere (vLLM's
    EngineDeadError is reported as this too)."""
