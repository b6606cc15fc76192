"""Bearer-token authentication.

With a token configured, every route except the public ones (``/healthz``, so a load
balancer or orchestrator can probe without the secret, and ``/openapi.json``, which holds no
data) needs ``Authorization: Bearer <token>``. The comparison is constant-time
(``hmac.compare_digest`` over bytes), and the token is never logged nor echoed.
"""

from __future__ import annotations

import hmac

from .errors import ApiError

ENV = "ROLLOUTS_API_TOKEN"
PUBLIC = frozenset({"/healthz", "/openapi.json"})


class BearerAuth:
    def __init__(self, token: str | None) -> None:
        if token is not None and not token:
            raise ValueError("the API token must not be empty")
        self._token = None if token is None else token.encode()

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, path: str, header: str | None) -> None:
        """Raise ``ApiError`` 401 unless ``path`` is public or ``header`` holds the token."""
        if self._token is None or path in PUBLIC:
            return
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), self._token
        ):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token")

    def __repr__(self) -> str:  # never the token itself, whatever prints this object
        return f"BearerAuth(enabled={self.enabled})"
