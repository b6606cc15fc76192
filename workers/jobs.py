"""The function rq records for rollout jobs (``store.queue.JOB_FUNC``)."""

from __future__ import annotations


def run_rollout(rollout_id: str) -> None:
    """Never called by a rollouts worker, which handles these jobs on its resident engine."""
    raise RuntimeError(
        f"rollout {rollout_id!r} was picked up by a stock rq worker; run `rollouts worker` "
        "instead (it keeps the engine loaded and many rollouts in flight)"
    )
