"""The API's one error type, and how each named error of the trainer API maps to a status.

Every refusal is a 4xx with ``{"error": {"type", "message", "field"}}``; ``field`` is the
request field at fault where one is known (pydantic's ``loc``, or the name the trainer API's
message starts with). A write Redis refuses for a condition of its own (out of memory, a failed
disk write, a read-only replica: ``store.errors.StoreUnwritable``) is a 503 with the reason and
a ``Retry-After``: nothing was written and the same call succeeds once the condition clears.
Only an exception not named here is a 500, with no internals in it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from statemachine import FailureClass, InvalidRequest
from store import defaults
from store.batches import BatchConflict
from store.cluster_appends import ClusterUnsupported
from store.completions import UnknownPosition, WaitTimeout
from store.errors import (
    ClaimLost,
    GroupNotFound,
    InvalidRolloutId,
    RolloutExists,
    RolloutNotFound,
    StoreError,
    unwritable,
)
from store.lifecycle import RolloutEnded
from store.weights import StaleWeightVersion

from .harness.call import CallerGone, CallFailed, Overloaded


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        field: str | None = None,
        *,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 worth retrying)

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "field": self.field}}

    def openai_body(self) -> dict[str, Any]:
        """The error body OpenAI's API and vLLM's server answer with (``code``: the status,
        as vLLM sends it), which the harnesses' clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.field,
                          "code": self.status}}  # fmt: skip


# Most specific first: RolloutEnded, BatchConflict, StaleWeightVersion and GroupNotFound are
# ValueErrors.
_NAMED: tuple[tuple[type[Exception], int, str], ...] = (
    (RolloutNotFound, 404, "not_found"),
    (GroupNotFound, 404, "not_found"),  # named in the body, like an unknown rollout's id
    (RolloutEnded, 409, "rollout_ended"),
    (BatchConflict, 409, "batch_conflict"),
    (RolloutExists, 409, "rollout_exists"),
    (StaleWeightVersion, 409, "stale_weight_version"),
    # A zombie environment runner's report: the call is another claim's now, or ended.
    (ClaimLost, 409, "claim_lost"),
    (InvalidRolloutId, 422, "invalid_id"),
    # Well-formed, but no result of the batch is there: not a validation error (the document
    # cannot know a batch's positions), a position not found, named as such.
    (UnknownPosition, 404, "unknown_position"),
    (InvalidRequest, 422, "invalid_request"),
    (WaitTimeout, 504, "timeout"),
    # Asked of a store on Redis Cluster, which does not offer it (yet): nothing was written.
    (ClusterUnsupported, 501, "cluster_unsupported"),
)

# "prompts[3]: sampling.max_tokens must be ..." -> "prompts.3.sampling.max_tokens"
_LEADING_NAME = re.compile(r"^([A-Za-z_][\w\[\].]*)(?::\s*([A-Za-z_][\w\[\].]*))?")


def from_exception(exc: Exception) -> ApiError | None:
    """The ``ApiError`` of a named exception, or None for one that is not (a bug: 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    refused = unwritable(exc)  # the client's StoreUnwritable, or a redis-py reply saying so
    if refused is not None:
        return ApiError(
            503, "store_unwritable", f"{refused}; nothing was written, retry later",
            retry_after_s=defaults.STORE_RETRY_AFTER_S,
        )  # fmt: skip
    if isinstance(exc, Overloaded):
        # 429 + Retry-After: what the openai client retries by itself (SkyRL's endpoints
        # answer their own way: see store.api.harness).
        return ApiError(429, "overloaded", str(exc), retry_after_s=1)
    if isinstance(exc, CallerGone):
        # Nobody reads this answer (nginx's 499): counted in the metrics, not logged as a bug.
        return ApiError(499, "caller_gone", str(exc))
    if isinstance(exc, CallFailed):
        # A request the worker refused (too long for the model, ...) is the caller's error;
        # any other end without an answer (failed, cancelled) is the server's.
        r = exc.result
        status = 400 if r.failure is FailureClass.REQUEST_ERROR else 500
        return ApiError(status, f"rollout_{r.status.value}", str(exc))
    for cls, status, type_ in _NAMED:
        if isinstance(exc, cls):
            message = str(exc)
            if isinstance(exc, UnknownPosition):
                return ApiError(status, type_, message, "after")  # the one field it can be
            return ApiError(status, type_, message, _field_of(message) if status == 422 else None)
    return None


def from_validation(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> ApiError:
    first = exc.errors(include_url=False)[0]
    loc = (*prefix, *first["loc"])
    field = ".".join(str(p) for p in loc) or None
    count = exc.error_count()
    more = f" (and {count - 1} more)" if count > 1 else ""
    where = f"{field}: " if field else ""
    return ApiError(422, "invalid_request", f"{where}{first['msg']}{more}", field)


def refused(exc: ValueError, field: str | None = None) -> ApiError:
    """A ``ValueError`` the trainer API documents for a call (e.g. a group out of range)."""
    return ApiError(422, "invalid_request", str(exc), field)


def _field_of(message: str) -> str | None:
    # store.keys names ids in words: "batch id must be ...", "rollout id must be ...".
    for words, field in (("batch id ", "batch_id"), ("rollout id ", "ids"),
                         ("session id ", "session")):  # fmt: skip
        if message.startswith(words):
            return field
    m = _LEADING_NAME.match(message)
    if m is None:
        return None
    # A second name only after "prompts[i]: " (the client prefixes the prompt at fault).
    parts = [p for p in m.groups() if p] if m.group(1).startswith("prompts[") else [m.group(1)]
    name = ".".join(parts).replace("[]", "").replace("[", ".").replace("]", "")
    return name.strip(".") or None


__all__ = ["ApiError", "StoreError", "from_exception", "from_validation", "refused"]
