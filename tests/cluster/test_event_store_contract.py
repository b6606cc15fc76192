"""The event store's contract (tests/store/test_event_store_contract.py), every test of it, on
a real Redis Cluster: the same appends, refusals, retries and reads, each rollout's keys in
their own slot and a checkpoint's rollouts spread over every master."""

from __future__ import annotations

from tests.store.test_event_store_contract import *  # noqa: F403

# The one test that builds a client of its own from one Redis's pool (``redis_client``) is
# about the client, not where it points: it runs in tests/store, not again here.
del test_client_must_not_decode_responses  # noqa: F821
