"""The API's one error type, and how each named error of the trainer API maps to a status.

Every refusal is a 4xx with ``{"error": {"type", "message", "field"}}``; ``field`` is the
request field at fault where one is known (pydantic's ``loc``, or the name the trainer API's
message starts with). Only an exception not named here is a 500, with no internals in it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from statemachine import InvalidRequest
from store.batches import BatchConflict
from store.completions import WaitTimeout
from store.errors import InvalidRolloutId, RolloutExists, RolloutNotFound, StoreError
from store.lifecycle import RolloutEnded
from store.weights import StaleWeightVersion


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "field": self.field}}


# Most specific first: RolloutEnded, BatchConflict and StaleWeightVersion are ValueErrors.
_NAMED: tuple[tuple[type[Exception], int, str], ...] = (
    (RolloutNotFound, 404, "not_found"),
    (RolloutEnded, 409, "rollout_ended"),
    (BatchConflict, 409, "batch_conflict"),
    (RolloutExists, 409, "rollout_exists"),
    (StaleWeightVersion, 409, "stale_weight_version"),
    (InvalidRolloutId, 422, "invalid_id"),
    (InvalidRequest, 422, "invalid_request"),
    (WaitTimeout, 504, "timeout"),
)

# "prompts[3]: sampling.max_tokens must be ..." -> "prompts.3.sampling.max_tokens"
_LEADING_NAME = re.compile(r"^([A-Za-z_][\w\[\].]*)(?::\s*([A-Za-z_][\w\[\].]*))?")


def from_exception(exc: Exception) -> ApiError | None:
    """The ``ApiError`` of a named exception, or None for one that is not (a bug: 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    for cls, status, type_ in _NAMED:
        if isinstance(exc, cls):
            message = str(exc)
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
    for words, field in (("batch id ", "batch_id"), ("rollout id ", "ids")):
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
