"""rq's ``resolve_serializer``, answered once per serializer object.

rq 3.0 calls it for every Job, Result and registry object it builds (five per rollout in a
worker), and each call checks ``isinstance(serializer, Serializer)`` against a
runtime-checkable Protocol, which Python 3.11 answers by walking the Protocol's attributes
every time: ~13 us a call, ~6% of a worker's CPU per rollout (py-spy of 16-token rollouts on
the synthetic engine). The answer for one serializer object never changes, so the first is
kept; None and dotted paths still go to rq's function every time, as do objects it refuses.
Installed by ``store.queue``, which everything here that uses rq imports.
"""

from __future__ import annotations

from typing import Any

import rq.job
import rq.queue
import rq.registry
import rq.results
import rq.serializers

_rq_resolve = rq.serializers.resolve_serializer
# id -> (the object, rq's answer): the object is kept so that its id is never reused.
_known: dict[int, tuple[Any, Any]] = {}


def resolve_serializer(serializer: Any = None) -> Any:
    if serializer is None or isinstance(serializer, str):
        return _rq_resolve(serializer)
    hit = _known.get(id(serializer))
    if hit is not None and hit[0] is serializer:
        return hit[1]
    resolved = _rq_resolve(serializer)  # raises for an object without dumps and loads
    _known[id(serializer)] = (serializer, resolved)
    return resolved


# rq's modules bound the function by name at import: each binding is replaced.
PATCHED = (rq.job, rq.queue, rq.registry, rq.results, rq.serializers)
for _module in PATCHED:
    if getattr(_module, "resolve_serializer", None) is _rq_resolve:
        _module.resolve_serializer = resolve_serializer  # type: ignore[attr-defined]
