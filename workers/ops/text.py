"""How the operator commands print what ``store.inspect`` and ``store.timeline`` read: text for
people, and the ``--json`` form for scripts. No I/O besides building strings."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from statemachine import LIVE, TERMINAL, Status
from store.inspect import ClusterStatus, RolloutNow, StuckRollout
from store.sessions import SessionCall
from store.timeline import Entry, Timeline
from workers.ops import episode_text


# -- status -----------------------------------------------------------------------------------
def status_text(s: ClusterStatus) -> str:
    live = "  ".join(f"{st.value} {s.by_state[st]}" for st in Status if st not in TERMINAL)
    ended = "  ".join(f"{st.value} {s.by_state[st]}" for st in Status if st in TERMINAL)
    queues = ", ".join(f"{q} {n}" for q, n in sorted(s.queues.items())) or "none"
    if s.latest is None:
        weights = "none published"
    else:
        ago = time.time() - s.latest.at
        weights = f"v{s.latest.version} ({s.latest.path}), published {_age(ago)} ago"
    lines = [
        f"rollouts     {live}   (now)",
        f"             {ended}   (ever)",
        f"tokens       {s.tokens} generated",
        f"queues       {queues}   (jobs waiting)",
        f"weights      latest {weights}",
        f"leases       {s.leases} held, {s.expired_leases} expired; "
        f"{s.quarantined} rollouts quarantined",
        f"workers      {len(s.workers)} live",
    ]
    if s.refusal is not None:
        lines.insert(0, f"store        REFUSING WRITES ({s.refusal.refusal.value}): "
                        f"{s.refusal.detail}")  # fmt: skip
        lines.insert(1, "             workers keep their rollouts and retry; they take no new "
                        "job until Redis accepts writes again")  # fmt: skip
    else:
        lines.insert(0, "store        accepting writes")
    lines.insert(1 if s.refusal is None else 2, _admission(s))
    if s.workers:
        rows = [("WORKER", "IN-FLIGHT", "WEIGHTS", "LAG", "HEARTBEAT", "QUEUES", "MODEL",
                 "ADMITS")]  # fmt: skip
        for w in s.workers:
            b = w.beat
            rows.append((
                b.worker_id, str(b.in_flight),
                "?" if b.weight_version is None else f"v{b.weight_version}",
                "?" if w.lag is None else str(w.lag), f"{w.heartbeat_age_s:.1f}s ago",
                ",".join(b.queues), b.model or "?", "no (paused)" if b.paused else "yes",
            ))  # fmt: skip
        lines += ["  " + line for line in _table(rows)]
    if s.expired_leases or s.quarantined:
        lines.append("see `rollouts stuck` for the rollouts that will not move on by themselves")
    return "\n".join(lines)


def _admission(s: ClusterStatus) -> str:
    p = s.paused
    if p is None:
        return "admission    open (not paused)"
    since = datetime.fromtimestamp(p.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (f"admission    PAUSED (mode {p.mode}) since {since}, {_age(time.time() - p.at)} "
            "ago: workers take no new job until POST /resume")  # fmt: skip


def status_json(s: ClusterStatus) -> dict[str, Any]:
    refusal = s.refusal
    return {
        "paused": None if s.paused is None else {"mode": s.paused.mode, "since": s.paused.at},
        "store": {
            "writable": refusal is None,
            "refusal": None if refusal is None else refusal.refusal.value,
            "message": None if refusal is None else refusal.detail,
        },
        "rollouts": {st.value: n for st, n in s.by_state.items()},
        "tokens": s.tokens,
        "queues": s.queues,
        "latest_weights": None
        if s.latest is None
        else {"version": s.latest.version, "path": s.latest.path, "published_at": s.latest.at},
        "leases": s.leases,
        "expired_leases": s.expired_leases,
        "quarantined": s.quarantined,
        "workers": [
            {
                "worker_id": w.beat.worker_id,
                "in_flight": w.beat.in_flight,
                "weight_version": w.beat.weight_version,
                "weight_lag": w.lag,
                "heartbeat_age_s": round(w.heartbeat_age_s, 3),
                "queues": list(w.beat.queues),
                "model": w.beat.model,
                "paused": w.beat.paused is not None,
            }
            for w in s.workers
        ],
    }


# -- show -------------------------------------------------------------------------------------
def timeline_text(t: Timeline, now: RolloutNow) -> str:
    s = t.state
    versions = ", ".join(f"v{v}: {n}" for v, n in t.by_version.items())
    head = f"rollout {t.rollout_id}: {s.status.value}, {s.num_tokens} tokens"
    head += f" ({versions})" if versions else ""
    head += f", {s.attempt} attempt{'s' if s.attempt != 1 else ''}"
    where = (
        f"batch {t.batch_id or '(none)'}, group {t.group_index}, sample {t.sample_index} of "
        f"{t.group_size}; prompt {t.prompt_tokens} tokens, max_tokens {t.max_tokens}; queue "
        f"{t.queue}; weights v{t.admitted_version} at submit"
    )
    start = t.entries[0].at
    lines = [head, where]
    for e in t.entries:
        stamp = datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        offset = f"+{e.at - start:.3f}s"
        lines.append(f"  {stamp}  {offset:>9}  {_describe(e)}")
    if s.request.episode is not None:
        lines += episode_text.section(s)
    lines.append(f"now: {_now_text(now)}")
    return "\n".join(lines)


def _describe(e: Entry) -> str:
    if e.kind == "submitted":
        return "submitted"
    if e.kind == "started":
        return f"attempt {e.attempt} started on worker {e.worker_id}, weights v{e.weight_version}"
    if e.kind == "resumed":
        return (
            f"attempt {e.attempt} resumed on worker {e.worker_id} from {e.tokens} saved "
            f"tokens, weights v{e.weight_version}"
        )
    if e.kind == "checkpoints":
        versions = ", ".join(f"v{v}: {n}" for v, n in e.by_version.items())
        span = (e.until or e.at) - e.at
        return (
            f"  saved {e.tokens} tokens in {e.checkpoints} checkpoint"
            f"{'s' if e.checkpoints != 1 else ''} over {span:.2f}s ({versions})"
        )
    if e.kind == "aborted":
        detail = f" ({e.detail})" if e.detail else ""
        return f"attempt {e.attempt} aborted: {e.reason}{detail}; {e.tokens} tokens saved"
    if e.kind == "finished":
        stop = f" (stop {e.detail})" if e.detail else ""
        return f"finished: {e.reason}{stop}; {e.tokens} tokens in total"
    if e.kind == "failed":
        return f"failed ({e.reason}) after {e.attempt} attempts: {e.detail}; {e.tokens} tokens"
    if e.kind == "cancelled":
        return f"cancelled: {e.detail or 'no reason given'}; {e.tokens} tokens kept"
    return episode_text.describe(e) or e.kind


def _now_text(now: RolloutNow) -> str:
    s = now.state
    parts = []
    if s is not None and s.status in TERMINAL:
        parts.append(f"ended ({s.status.value})")
    elif s is not None and s.status in LIVE:
        left = now.lease_left_s()
        if left is None:
            parts.append(f"generating on {s.worker_id}, no lease held")
        elif left > 0:
            parts.append(f"generating on {s.worker_id}, lease valid {left:.1f}s more")
        else:
            parts.append(f"generating on {s.worker_id}, lease expired {-left:.1f}s ago")
    elif s is not None:
        parts.append(f"waiting ({s.status.value})")
    for j in now.jobs:
        on = f" by {j.worker}" if j.worker else ""
        lapsed = "" if j.alive else ", heartbeat lapsed"
        parts.append(f"job {j.job_id} {j.where} on {j.queue}{on}{lapsed}")
    if s is not None and s.status not in TERMINAL and not now.jobs:
        parts.append("no rq job")
    if now.quarantine is not None:
        parts.append(f"quarantined: {now.quarantine}")
    return "; ".join(parts)


def now_json(now: RolloutNow) -> dict[str, Any]:
    return {
        "lease_expiry_ms": now.lease_expiry_ms,
        "quarantine": now.quarantine,
        "jobs": [
            {"job_id": j.job_id, "queue": j.queue, "where": j.where, "alive": j.alive,
             "worker": j.worker}
            for j in now.jobs
        ],
    }  # fmt: skip


# -- stuck ------------------------------------------------------------------------------------
def stuck_text(stuck: list[StuckRollout]) -> str:
    if not stuck:
        return "no stuck rollouts"
    rows = [("ROLLOUT", "STATUS", "KIND", "WHY")]
    rows += [(s.rollout_id, s.status, s.kind, s.why) for s in stuck]
    lines = [f"{len(stuck)} stuck rollout{'s' if len(stuck) != 1 else ''}:"]
    lines += ["  " + line for line in _table(rows)]
    lines.append(
        "`rollouts requeue ID...` gives each a job again (it resumes from its saved tokens)"
    )
    return "\n".join(lines)


def stuck_json(stuck: list[StuckRollout]) -> list[dict[str, Any]]:
    return [
        {"rollout_id": s.rollout_id, "status": s.status, "kind": s.kind, "why": s.why,
         "seq": s.seq, "queue": s.queue, "worker_id": s.worker_id, "tokens": s.tokens}
        for s in stuck
    ]  # fmt: skip


def session_text(session_id: str, calls: Sequence[SessionCall]) -> str:
    if not calls:
        return f"session {session_id!r}: no calls recorded (none, or all acknowledged or expired)"
    rows = [("#", "CALL", "MADE", "ROLLOUTS")]
    for i, c in enumerate(calls):
        states = ", ".join(f"{r} {s}" for r, s in zip(c.ids, c.statuses, strict=True))
        made = datetime.fromtimestamp(c.at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        rows.append((str(i), c.batch_id, made, states))
    return "\n".join([f"session {session_id!r}: {len(calls)} call(s), in order", *_table(rows)])


def session_json(session_id: str, calls: Sequence[SessionCall]) -> dict[str, Any]:
    return {"session_id": session_id, "calls": [
        {"batch_id": c.batch_id, "at": c.at, "ids": c.ids, "states": list(c.statuses)}
        for c in calls]}  # fmt: skip


# -- helpers ----------------------------------------------------------------------------------
def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
