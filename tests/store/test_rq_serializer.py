"""rq's serializer check, answered once per serializer (``store/rq_serializer.py``): the same
answers as rq's own function, for everything rq builds."""

from __future__ import annotations

import fakeredis
import pytest
import rq.job
import rq.queue
import rq.registry
import rq.results
import rq.serializers
from rq.serializers import DefaultSerializer, JSONSerializer

import store.queue  # noqa: F401  (installs it)
from store import rq_serializer


def test_every_rq_module_that_resolves_serializers_uses_it() -> None:
    for module in (rq.job, rq.queue, rq.registry, rq.results, rq.serializers):
        assert module.resolve_serializer is rq_serializer.resolve_serializer, module


def test_same_answers_as_rq() -> None:
    resolve, rqs = rq_serializer.resolve_serializer, rq_serializer._rq_resolve
    for given in (None, JSONSerializer, "rq.serializers.JSONSerializer", "json", DefaultSerializer):
        assert resolve(given) is rqs(given)
        assert resolve(given) is rqs(given)  # the second answer, from what was kept

    class NoLoads:
        def dumps(self, obj: object) -> bytes:
            return b""

    for _ in range(2):  # refused every time, never kept
        with pytest.raises(NotImplementedError):
            resolve(NoLoads())


def test_what_rq_builds_gets_its_serializer() -> None:
    conn = fakeredis.FakeRedis()
    job = rq.job.Job(id="j1", connection=conn, serializer=JSONSerializer)
    assert job.serializer is JSONSerializer
    assert job.started_job_registry.serializer is JSONSerializer
    result = rq.results.Result(
        "j1", rq.results.Result.Type.SUCCESSFUL, conn, serializer=JSONSerializer
    )
    assert result.serializer is JSONSerializer
