"""Where rq's queue lives: the store's Redis (the default) or a Redis of its own.

rq runs on one Redis (its dequeue spans keys no cluster slot holds together), so a store on
Redis Cluster needs the queue apart (``--queue-redis``). Nothing durable lives only in the
queue: each rollout's snapshot names its job, and ``rollouts requeue --all-waiting`` rebuilds
a lost queue from the store (docs/scale.md).

With the queue on the store's Redis, the steps that touch both (submit, ack, a reaper's give
back, a job's success) stay one atomic script, as they always were. With it apart they are
ordered steps, store first: a rollout recorded but not yet enqueued (a crash between the
two) is found by the stranded sweep (``workers.stranded``) and given its job then.
"""

from __future__ import annotations

import argparse
import os

from store.errors import InvalidRedisUrl
from store.slots import is_cluster_url

QUEUE_URL_ENV = "ROLLOUTS_QUEUE_REDIS_URL"


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue-redis",
        metavar="URL",
        help=f"Redis URL of rq's queue, when it is not the store's (default: ${QUEUE_URL_ENV}, "
        "else the store's Redis). Required when --redis is a cluster: rq runs on one Redis",
    )


def resolve(store_url: str, flag: str | None = None, env: dict[str, str] | None = None) -> str:
    """The queue's URL: ``flag``, else ``$ROLLOUTS_QUEUE_REDIS_URL``, else the store's own
    (refused for a cluster, which rq cannot run on)."""
    url = flag or (os.environ if env is None else env).get(QUEUE_URL_ENV) or None
    if url is not None:
        if is_cluster_url(url):
            raise InvalidRedisUrl("rq's queue runs on one Redis: --queue-redis takes a "
                                  "redis:// URL, not a cluster's")  # fmt: skip
        return url
    if is_cluster_url(store_url):
        raise InvalidRedisUrl("a store on Redis Cluster needs the queue on one Redis of its "
                              "own: give --queue-redis redis://host:port")  # fmt: skip
    return store_url


def apart(store_url: str, queue_url: str | None) -> bool:
    """Whether the queue is on a Redis other than the store's: then nothing may touch keys of
    both in one step. Two URLs that differ only in spelling count as apart, which is safe (the
    ordered steps are correct on one server too), only less atomic."""
    return queue_url is not None and queue_url != store_url
