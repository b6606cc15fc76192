"""The soak's trainer: the demo's RL loop (``workers/demo/loop.py``), made to outlast faults.

Each step submits ``prompts x samples`` greedy rollouts as one batch while the previous step's
rollouts are consumed in completion order (from the batch's results stream, resumed from the
last position after any error), publishes new weights once a step is consumed, and
acknowledges each group once its last sample arrived. Every rollout is read back before it is
acknowledged (its log and its snapshot) and audited at once (``soak_audit.check_rollout``), so
that a half-hour soak keeps verdicts, not logs.

Redis restarts and short out-of-memory spells are the soak's own doing: a trainer call that
meets one (a dropped connection, LOADING, a write refused: ``store.errors.unwritable``) is
retried with backoff for up to ``RETRY_FOR_S`` and counted; any other error is recorded (the
audit's ``trainer_ran_clean``) and the loop goes on. A step whose rollouts have not all ended
within ``step_timeout_s`` is left for the final drain, so one stranded rollout cannot stall
the soak: the audit names it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from soak_audit import Audit, Captured, Reference, check_rollout

from statemachine import RolloutRequest, SamplingParams
from store import completions
from store.client import RolloutClient
from store.completions import WaitTimeout
from store.errors import RolloutNotFound, unwritable
from store.event_store import EventStore
from store.results import RolloutResult
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.synthetic import SyntheticEngine

T = TypeVar("T")
TRAINER = "trainer_ran_clean"
RETRY_FOR_S = 60.0  # past a Redis restart (AOF replay included) and an OOM spell
BACKOFF_S = (0.1, 2.0)  # first, cap


def transient(exc: BaseException) -> str | None:
    """What kind of passing trouble ``exc`` is (the soak's own faults), or None."""
    refused = unwritable(exc)  # OOM, MISCONF, READONLY: the store's one recogniser
    if refused is not None:
        return refused.refusal.value
    if isinstance(exc, BusyLoadingError):
        return "loading"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ConnectionError):
        return "connection"
    if isinstance(exc, ResponseError) and str(exc).startswith("LOADING"):
        return "loading"
    return None


async def retrying(what: str, call: Callable[[], Awaitable[T]], counts: Counter[str]) -> T:
    deadline = time.monotonic() + RETRY_FOR_S
    delay = BACKOFF_S[0]
    while True:
        try:
            return await call()
        except Exception as exc:
            kind = transient(exc)
            if kind is None or time.monotonic() > deadline:
                raise
            counts[f"{what}: {kind}"] += 1
            await asyncio.sleep(delay)
            delay = min(BACKOFF_S[1], delay * 2)


class Weights:
    """Publishes the next weight version (the trainer after each step, the faults at random
    moments): one at a time, so versions arrive in order."""

    def __init__(
        self,
        client: RolloutClient,
        checkpoint: Callable[[int], Awaitable[str]],
        counts: Counter[str],
    ) -> None:
        self.client, self.checkpoint, self.counts = client, checkpoint, counts
        self.version = 0
        self._lock = asyncio.Lock()

    async def publish_next(self) -> int:
        async with self._lock:
            version = self.version + 1
            path = await self.checkpoint(version)
            await retrying(
                "publish", lambda: self.client.publish_weights(version, path), self.counts
            )
            self.version = version
            return version


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    prompts: int
    samples: int
    tokens: tuple[int, int]  # max_tokens of a prompt: drawn from this range
    step_timeout_s: float
    vocab: int  # prompt token ids are drawn below it


@dataclass(slots=True)
class BatchReader:
    """One step's batch, read from its results stream; resumable after any error."""

    batch_id: str
    ids: list[str]
    group_size: int
    position: str = completions.START
    delivered: set[str] = field(default_factory=set)
    groups: dict[int, list[str]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.delivered) == len(self.ids)


class Trainer:
    def __init__(
        self,
        client: RolloutClient,
        cfg: TrainerConfig,
        rng: random.Random,
        audit: Audit,
        weights: Weights,
        counts: Counter[str],
        *,
        synthetic_reference: bool,
    ) -> None:
        self.client, self.cfg, self.rng, self.audit = client, cfg, rng, audit
        self.weights, self.counts = weights, counts
        self.synthetic_reference = synthetic_reference
        self.readers: list[BatchReader] = []
        self.submitted: list[str] = []
        self.results: list[RolloutResult] = []  # kept only without a synthetic reference
        self.steps = 0
        self.errors = 0
        self._references: dict[tuple[tuple[int, ...], int], Reference] = {}

    # -- the loop ---------------------------------------------------------------------------
    async def run(self, until: float) -> None:
        """Steps until ``until`` (monotonic); the last submitted step is consumed before it
        returns, or left for ``drain`` if it does not end in time."""
        upcoming = await self._submit(0)
        while upcoming is not None:
            current = upcoming
            upcoming = await self._submit(self.steps + 1) if time.monotonic() < until else None
            await self.read(current, time.monotonic() + self.cfg.step_timeout_s)
            self.steps += 1
            try:
                await self.weights.publish_next()
            except Exception as exc:
                self._error(f"publishing weights after step {self.steps}", exc)

    async def drain(self, deadline: float) -> list[str]:
        """Read every unfinished batch, side by side, to its end or until ``deadline``;
        returns the rollouts not delivered yet."""
        left = [r for r in self.readers if not r.complete]
        await asyncio.gather(*(self.read(r, deadline) for r in left))
        return [rid for r in self.readers for rid in r.ids if rid not in r.delivered]

    async def ack_leftovers(self) -> None:
        """Groups with a sample never delivered were never acknowledged: the delivered
        samples go now."""
        leftover = [rid for r in self.readers for g in r.groups.values() for rid in g]
        if leftover:
            await self._ack(leftover)

    async def _submit(self, step: int) -> BatchReader | None:
        requests = [self._request() for _ in range(self.cfg.prompts)]
        batch_id = f"soak-step-{step}"
        try:
            batch = await retrying(
                "submit",
                lambda: self.client.submit(requests, n=self.cfg.samples, batch_id=batch_id),
                self.counts,
            )
        except Exception as exc:
            self._error(f"submitting {batch_id}", exc)
            return None
        reader = BatchReader(batch_id, list(batch), batch.group_size)
        self.readers.append(reader)
        self.submitted += reader.ids
        return reader

    def _request(self) -> RolloutRequest:
        prompt = tuple(
            self.rng.randrange(10, self.cfg.vocab) for _ in range(self.rng.randint(4, 12))
        )
        n = self.rng.randint(*self.cfg.tokens)
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return RolloutRequest(prompt_token_ids=prompt, sampling=sampling)

    # -- reading a batch --------------------------------------------------------------------
    async def read(self, reader: BatchReader, deadline: float) -> None:
        delay = BACKOFF_S[0]
        while not reader.complete and time.monotonic() < deadline:
            try:
                async for r in self.client.results(
                    reader.batch_id, after=reader.position, timeout=deadline - time.monotonic()
                ):
                    reader.position = r.position
                    await self._consume(reader, r)
                if reader.complete:
                    await self.ack_batch(reader)
                return
            except WaitTimeout:
                return  # left for the drain (or named stranded by the audit)
            except Exception as exc:
                kind = transient(exc)
                if kind is None:
                    self._error(f"reading {reader.batch_id}", exc)
                    return
                self.counts[f"results: {kind}"] += 1
                await asyncio.sleep(delay)
                delay = min(BACKOFF_S[1], delay * 2)

    async def _consume(self, reader: BatchReader, r: RolloutResult) -> None:
        self.audit.delivered(r.rollout_id)
        if r.rollout_id in reader.delivered:
            return  # delivered twice: counted; audited once
        reader.delivered.add(r.rollout_id)
        await self.audit_one(r.rollout_id, r)
        group = reader.groups.setdefault(r.group_index, [])
        group.append(r.rollout_id)
        if len(group) == reader.group_size:
            del reader.groups[r.group_index]
            await self._ack(group)

    async def audit_one(self, rid: str, result: RolloutResult | None, stranded: str = "") -> None:
        """Read the rollout back (log and snapshot) and audit it; ``result``: what the trainer
        was given (None: never delivered, ``stranded`` says why)."""
        try:
            captured = await retrying(
                "read back", lambda: capture(self.client.store, rid), self.counts
            )
        except Exception as exc:
            self._error(f"reading back {rid}", exc)
            return
        if isinstance(captured.snapshot, RolloutNotFound) and not isinstance(captured.events, list):
            self.audit.missing(rid, stranded or "gone before it was read back")
            return
        captured.result = result
        request = _request_of(captured)
        if self.synthetic_reference and request is not None:
            captured.reference = await self._reference(request)
        elif result is not None:
            self.results.append(result)  # checked by weight segment at the end
        self.audit.add(check_rollout(captured), stranded=stranded)

    async def _reference(self, request: RolloutRequest) -> Reference:
        key = (request.prompt_token_ids, request.sampling.max_tokens)
        found = self._references.get(key)
        if found is None:
            # The synthetic engine is resume-exact: unpaced and alone, it gives the tokens an
            # uninterrupted run gives, whatever the weights (its tokens ignore them).
            engine = SyntheticEngine()
            req = EngineRequest(
                request_id="ref", prompt_token_ids=key[0], sampling=request.sampling
            )
            joined = join_chunks([c async for c in engine.generate(req)])
            found = Reference(np.asarray(joined.token_ids), np.asarray(joined.logprobs))
            self._references[key] = found
        return found

    async def _ack(self, ids: list[str]) -> None:
        try:
            report = await retrying("ack", lambda: self.client.ack(ids), self.counts)
        except Exception as exc:
            self._error(f"acknowledging {len(ids)} rollouts", exc)
            return
        if report.live:
            # Delivered as ended, yet live: the completion stream and the state disagree.
            self.audit.record(TRAINER, f"ack of {ids}: live {report.live}")
        # Missing is not wrong in itself: an ack whose reply a Redis restart lost is sent
        # again by the client's retry, and then finds what it deleted gone. Counted.
        if report.missing:
            self.counts["ack: missing (a retried ack)"] += len(report.missing)

    async def ack_batch(self, reader: BatchReader) -> None:
        """Every rollout of the batch is acknowledged by now; acknowledging the batch as a
        whole also deletes its record and completion stream (``RolloutClient.ack``), as
        tests/workers/test_trainer_loop.py does at the end of its batch."""
        try:
            await retrying("ack", lambda: self.client.ack(batch_id=reader.batch_id), self.counts)
        except Exception as exc:
            self._error(f"acknowledging batch {reader.batch_id}", exc)

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        self.audit.record(TRAINER, f"{what}: {type(exc).__name__}: {exc}")


async def capture(store: EventStore, rid: str) -> Captured:
    """A rollout as the audit reads it: its log decoded and ``load``'s view of it, each or
    the error it raised (transient errors are raised, for the caller to retry)."""
    [snapshot] = await store.load_many([rid])
    if isinstance(snapshot, Exception) and transient(snapshot):
        raise snapshot
    try:
        events: list[Any] | Exception = await store.events(rid)
    except Exception as exc:
        if transient(exc):
            raise
        events = exc
    if isinstance(events, list) and not events:
        events = RolloutNotFound(rid)
    head = None
    if isinstance(snapshot, Exception) and not isinstance(snapshot, RolloutNotFound):
        try:
            head = await store.head(rid)
        except Exception as exc:
            if transient(exc):
                raise
            # The snapshot is unreadable too: the audit says so without its figures.
    return Captured(rid, events, snapshot, head=head)


def _request_of(c: Captured) -> RolloutRequest | None:
    """The rollout's request, from its snapshot or else its ``Submitted`` record."""
    for source in (c.snapshot, c.events[0] if isinstance(c.events, list) and c.events else None):
        request = getattr(source, "request", None)
        if isinstance(request, RolloutRequest):
            return request
    return None
