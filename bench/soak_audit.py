"""The soak's audit: every rollout's log checked on its own, then the run as a whole.

Pure: it is handed what the soak read from Redis (a rollout's decoded log, its snapshot as
``EventStore.load`` gave it or the error it raised, the result the trainer was given, the tokens
of an uninterrupted run) and says what is wrong, so that a test can plant a defect in a log and
expect it caught (``tests/bench/test_soak_audit.py``). Nothing here reads Redis or a clock.

Per rollout (``check_rollout``):

- ``log_readable``: the log decodes and ``load`` reads the rollout;
- ``seq_contiguous``: the log's sequence numbers are 1..n;
- ``offsets_contiguous``: each ``TokensAppended`` starts where the tokens before it end (a gap
  or a duplicate is named by its offset);
- ``fold_equals_snapshot``: the fold of the log is legal and equals the snapshot;
- ``result_equals_log``: the trainer's result carries exactly the log's tokens;
- ``tokens_equal_reference``: the tokens are those of an uninterrupted greedy run (all of them
  for a done rollout, a prefix otherwise).

For the run (``Audit``): every submitted rollout ended and was delivered once
(``every_rollout_ended``, ``delivered_once``), none failed (``no_rollout_failed``: in a soak
whose faults leave each rollout far inside its budgets, a failure is a defect), nothing was
lost (``no_token_lost``), and whatever the soak itself recorded (``record``): Redis back at its
baseline, the trainer loop's own errors, the API's answers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from statemachine import (
    Aborted,
    AbortReason,
    Event,
    Resumed,
    RolloutState,
    Started,
    Status,
    TokensAppended,
    TransitionError,
    fold,
)
from store.results import RolloutResult

LOG_READABLE = "log_readable"
SEQ = "seq_contiguous"
OFFSETS = "offsets_contiguous"
FOLD = "fold_equals_snapshot"
RESULT = "result_equals_log"
REFERENCE = "tokens_equal_reference"
ENDED = "every_rollout_ended"
DELIVERED = "delivered_once"
NOT_FAILED = "no_rollout_failed"
NOTHING_LOST = "no_token_lost"
NO_FALSE_LOSS = "no_worker_lost_of_a_live_worker"
ROLLOUT_CHECKS = (LOG_READABLE, SEQ, OFFSETS, FOLD, RESULT, REFERENCE)
RUN_CHECKS = (ENDED, DELIVERED, NOT_FAILED, NOTHING_LOST, NO_FALSE_LOSS)

EXAMPLES = 5  # failures quoted per check; the rest are counted
PROBLEM_LOGS = 10  # rollouts whose whole log the report quotes


@dataclass(frozen=True, slots=True)
class Reference:
    """What an uninterrupted greedy run of the rollout's prompt gives."""

    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32] | None = None  # None: not compared


@dataclass(slots=True)
class Captured:
    """One rollout as the soak read it, before acknowledging it."""

    rollout_id: str
    events: list[Event] | Exception  # its log, decoded, or why it could not be
    snapshot: RolloutState | Exception  # ``EventStore.load``, or what it raised
    result: RolloutResult | None = None  # what the trainer was given; None: never delivered
    reference: Reference | None = None  # None: not checked here (checked by segment later)
    # The snapshot's head alone (``EventStore.head``: no token data) when ``load`` refused:
    # what the rollout's status and token count were, for the figures.
    head: RolloutState | None = None


@dataclass(slots=True)
class Verdict:
    """What ``check_rollout`` found, and the rollout's figures."""

    rollout_id: str
    status: str  # its Status value, or "unreadable"
    problems: dict[str, str] = field(default_factory=dict)  # check -> what is wrong
    tokens_saved: int = 0  # tokens its log holds
    tokens_lost: int = 0  # of those, not in what the trainer was given
    aborts: Counter[str] = field(default_factory=Counter)  # by reason
    # (attempt lost, its worker, how: process_gone | lease_expired | takeover | other)
    worker_lost: list[tuple[int, str, str]] = field(default_factory=list)
    failure: str | None = None  # "<class>: <error>" when it failed
    log: list[str] = field(default_factory=list)  # the log, one line an event, if a problem

    @property
    def ok(self) -> bool:
        return not self.problems


def check_rollout(c: Captured) -> Verdict:
    """Every per-rollout check of one captured rollout (see the module docstring)."""
    snap = c.snapshot
    v = Verdict(c.rollout_id, snap.status.value if isinstance(snap, RolloutState) else "unreadable")
    if isinstance(c.events, Exception):
        v.problems[LOG_READABLE] = f"log does not decode: {_name(c.events)}"
        known = snap if isinstance(snap, RolloutState) else c.head
        if known is not None:
            v.tokens_saved = known.num_tokens  # what the snapshot says the log held
        v.tokens_lost = v.tokens_saved
        v.log = [f"snapshot: {describe_state(known) if known else _name(snap)}"]
        return v
    events = c.events
    chunks = [e for e in events if isinstance(e, TokensAppended)]
    v.tokens_saved = sum(len(e) for e in chunks)
    _figures(v, events)
    if isinstance(snap, Exception):
        v.problems[LOG_READABLE] = f"load() refuses it: {_name(snap)}"
    else:
        v.status = snap.status.value
        if snap.status is Status.FAILED:
            v.failure = f"{snap.failure.value if snap.failure else '?'}: {snap.error}"
    _check_seq(v, events)
    _check_offsets(v, chunks)
    _check_fold(v, events, snap)
    log_ids = _concat([e.token_ids for e in chunks], np.int32)
    _check_result(v, c.result, chunks, log_ids)
    if c.reference is not None:
        _check_reference(v, c.reference, chunks, log_ids, done=v.status == Status.DONE.value)
    if v.problems or v.failure:
        v.log = [describe(e) for e in events]
        v.log.append(
            f"snapshot: {describe_state(snap) if isinstance(snap, RolloutState) else _name(snap)}"
        )
    return v


def describe(e: Event) -> str:
    """One event on one line, for a person reading a broken log."""
    what = f"#{e.seq} {type(e).__name__}"
    if isinstance(e, TokensAppended):
        return f"{what} attempt {e.attempt} offset {e.offset} +{len(e)} v{e.weight_versions[0]}"
    if isinstance(e, Started | Resumed):
        return f"{what} attempt {e.attempt} worker {e.worker_id} v{e.weight_version}"
    if isinstance(e, Aborted):
        return f"{what} attempt {e.attempt} {e.reason.value} ({e.detail})"
    fields = {
        k: getattr(e, k) for k in ("attempt", "finish_reason", "error", "reason") if hasattr(e, k)
    }
    return f"{what} {fields}" if fields else what


def describe_state(s: RolloutState) -> str:
    return (
        f"seq {s.seq} {s.status.value} attempt {s.attempt} worker {s.worker_id} "
        f"tokens {s.num_tokens} aborts {s.aborts}"
    )


def _check_seq(v: Verdict, events: list[Event]) -> None:
    seqs = [e.seq for e in events]
    if seqs != list(range(1, len(seqs) + 1)):
        bad = next(i for i, s in enumerate(seqs, 1) if s != i)
        v.problems[SEQ] = f"event #{bad} of the log has seq {seqs[bad - 1]}"


def _check_offsets(v: Verdict, chunks: list[TokensAppended]) -> None:
    end = 0
    for e in chunks:
        if e.offset != end:
            what = "duplicate" if e.offset < end else "gap"
            v.problems[OFFSETS] = (
                f"{what}: seq {e.seq} (attempt {e.attempt}) appends at offset {e.offset}, "
                f"the tokens before it end at {end}"
            )
            return
        end += len(e)


def _check_fold(v: Verdict, events: list[Event], snap: RolloutState | Exception) -> None:
    try:
        folded = fold(events)
    except TransitionError as exc:
        v.problems[FOLD] = f"illegal log: {_name(exc)}"
        return
    if folded is None:
        v.problems[FOLD] = "empty log"
    elif isinstance(snap, RolloutState) and folded != snap:
        diff = [
            f"{name} {getattr(snap, name)!r} (fold: {getattr(folded, name)!r})"
            for name in ("status", "seq", "attempt", "num_tokens", "aborts", "worker_id")
            if getattr(snap, name) != getattr(folded, name)
        ]
        v.problems[FOLD] = "snapshot differs from the fold: " + (
            ", ".join(diff) or "in its token data or another field"
        )


def _check_result(
    v: Verdict,
    result: RolloutResult | None,
    chunks: list[TokensAppended],
    log_ids: npt.NDArray[np.int32],
) -> None:
    if result is None:
        # Never delivered: the run-level checks say why; its saved tokens never reached the
        # trainer.
        v.tokens_lost = v.tokens_saved
        return
    got = np.asarray(result.response_token_ids)
    same = _common_prefix(got, log_ids)
    v.tokens_lost = len(log_ids) - same
    log_lps = _concat([e.logprobs for e in chunks], np.float32)
    if same != len(log_ids) or len(got) != len(log_ids):
        v.problems[RESULT] = (
            f"the trainer got {len(got)} tokens, the log holds {len(log_ids)}; they differ "
            f"from token {same}"
        )
    elif np.asarray(result.logprobs, np.float32).tobytes() != log_lps.tobytes():
        v.problems[RESULT] = "the trainer's logprobs differ from the log's"


def _check_reference(
    v: Verdict,
    ref: Reference,
    chunks: list[TokensAppended],
    log_ids: npt.NDArray[np.int32],
    *,
    done: bool,
) -> None:
    n = len(log_ids)
    if n > len(ref.token_ids) or (done and n != len(ref.token_ids)):
        v.problems[REFERENCE] = f"{n} tokens, the uninterrupted run has {len(ref.token_ids)}"
        return
    same = _common_prefix(log_ids, ref.token_ids[:n])
    if same != n:
        v.problems[REFERENCE] = (
            f"token {same} is {int(log_ids[same])}, the uninterrupted run's is "
            f"{int(ref.token_ids[same])}"
        )
        return
    if ref.logprobs is not None:
        lps = _concat([e.logprobs for e in chunks], np.float32)
        if lps.tobytes() != np.asarray(ref.logprobs[:n], np.float32).tobytes():
            v.problems[REFERENCE] = "logprobs differ from the uninterrupted run's"


def _figures(v: Verdict, events: list[Event]) -> None:
    workers: dict[int, str] = {}
    for e in events:
        if isinstance(e, Started | Resumed):
            workers[e.attempt] = e.worker_id
        elif isinstance(e, Aborted):
            v.aborts[e.reason.value] += 1
            if e.reason is AbortReason.WORKER_LOST:
                lost = (e.attempt, workers.get(e.attempt, "?"), how_lost(e.detail))
                v.worker_lost.append(lost)


def how_lost(detail: str) -> str:
    """How a ``worker_lost`` abort was decided, from its detail (workers/reaper.py and
    workers/runner.py word them)."""
    if detail.startswith("taken over by"):
        return "takeover"
    if detail.startswith("process of"):
        return "process_gone"
    if detail.startswith("lease of"):
        return "lease_expired"
    return "other"


def _concat(arrays: list[Any], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(arrays).astype(dtype) if arrays else np.empty(0, dtype)


def _common_prefix(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True)
class Check:
    failures: int = 0
    examples: list[str] = field(default_factory=list)
    skipped: str = ""  # why it could not be judged (a failure too)

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(what)

    @property
    def passed(self) -> bool:
        return self.failures == 0 and not self.skipped


class Audit:
    """The verdicts of every rollout, and of the run, with the figures they add up to."""

    def __init__(self) -> None:
        self.checks: dict[str, Check] = {name: Check() for name in (*ROLLOUT_CHECKS, *RUN_CHECKS)}
        self.statuses: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # failure class of failed rollouts
        self.aborts: Counter[str] = Counter()
        self.worker_lost: list[tuple[str, int, str, str]] = []  # (rollout, attempt, worker, how)
        self.worker_lost_per_rollout: Counter[int] = Counter()  # budget charged -> rollouts
        self.tokens_saved = 0
        self.tokens_lost: Counter[str] = Counter()  # by cause
        self.deliveries: Counter[str] = Counter()
        self.audited: set[str] = set()
        self.problem_logs: dict[str, list[str]] = {}

    def delivered(self, rollout_id: str) -> None:
        self.deliveries[rollout_id] += 1
        if self.deliveries[rollout_id] == 2:
            self.checks[DELIVERED].fail(f"{rollout_id} was delivered twice")

    def add(self, v: Verdict, *, stranded: str = "") -> None:
        """One rollout's verdict; ``stranded``: why it never ended (it was not delivered)."""
        self.audited.add(v.rollout_id)
        self.statuses[v.status] += 1
        if v.log and len(self.problem_logs) < PROBLEM_LOGS:
            self.problem_logs[v.rollout_id] = v.log
        for check, what in v.problems.items():
            self.checks[check].fail(f"{v.rollout_id}: {what}")
        if v.failure is not None:
            self.failures[v.failure.split(":")[0]] += 1
            self.checks[NOT_FAILED].fail(f"{v.rollout_id}: failed, {v.failure}")
        if stranded:
            self.checks[ENDED].fail(f"{v.rollout_id}: {stranded}")
        self.aborts.update(v.aborts)
        self.worker_lost += [(v.rollout_id, *lost) for lost in v.worker_lost]
        self.worker_lost_per_rollout[len(v.worker_lost)] += 1
        self.tokens_saved += v.tokens_saved
        if v.tokens_lost:
            cause = "unreadable" if LOG_READABLE in v.problems else (
                "never delivered" if stranded else "result short of the log"
            )  # fmt: skip
            self.tokens_lost[cause] += v.tokens_lost
            self.checks[NOTHING_LOST].fail(f"{v.rollout_id}: {v.tokens_lost} tokens ({cause})")

    def missing(self, rollout_id: str, why: str) -> None:
        """A submitted rollout the soak could not even read at the end."""
        self.audited.add(rollout_id)
        self.statuses["missing"] += 1
        self.checks[ENDED].fail(f"{rollout_id}: {why}")

    def record(self, check: str, what: str) -> None:
        """A failure of a run-level check the soak judged itself (memory, trainer, API)."""
        self.checks.setdefault(check, Check()).fail(what)

    def passing(self, check: str) -> None:
        """A run-level check the soak judged and found right (listed as passed)."""
        self.checks.setdefault(check, Check())

    def skip(self, check: str, why: str) -> None:
        self.checks.setdefault(check, Check()).skipped = why

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks.values())

    def budgets(
        self, killed: set[tuple[str, int]], stopped: set[tuple[str, int]]
    ) -> dict[str, Any]:
        """Worker-lost aborts (each charged to its rollout's budget): how each was decided,
        and whether the attempt lost was live on a worker when the soak SIGKILLed it
        (``killed``: (rollout, attempt) pairs), live on one it SIGTERMed (``stopped``: a
        stopping worker's loss is reported, not failed), or neither: a worker judged lost
        while it was alive, which fails ``no_worker_lost_of_a_live_worker`` once per abort."""
        of: Counter[str] = Counter()
        false = self.checks[NO_FALSE_LOSS]
        false.failures, false.examples = 0, []
        for rid, attempt, worker, how in self.worker_lost:
            fate = (
                "killed" if (rid, attempt) in killed
                else "stopping" if (rid, attempt) in stopped
                else "alive"
            )  # fmt: skip
            of[fate] += 1
            if fate == "alive":
                false.fail(f"{rid}: attempt {attempt} of {worker}, alive ({how})")
        return {
            "worker_lost": len(self.worker_lost),
            "worker_lost_by_how": dict(Counter(how for *_, how in self.worker_lost)),
            "worker_lost_of": dict(of),
            "rollouts_by_worker_lost_charged": {
                str(k): n for k, n in sorted(self.worker_lost_per_rollout.items())
            },
            "max_worker_lost_per_rollout": max(self.worker_lost_per_rollout, default=0),
        }

    def summary(self) -> dict[str, Any]:
        return {
            name: {
                "passed": c.passed,
                "failures": c.failures,
                **({"examples": c.examples} if c.examples else {}),
                **({"skipped": c.skipped} if c.skipped else {}),
            }
            for name, c in self.checks.items()
        }
