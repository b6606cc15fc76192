"""``bench/bench_cluster.py --json`` runs end to end at a small size on real loopback clusters
(1, 3 and 6 masters, and 3 masters with a replica each) and one plain redis-server, and reports
every figure: a group commit costs one round trip per master it touches (a count, so exact),
500 rollouts spread over 3 masters within 1.5x, the capacity table for every rate, the cost per
token of groups of 1 beside groups of 8, and the lease index's cost on one index and over 16
shards (50 workers' leases: a fraction of a second)."""

from __future__ import annotations

import math

import pytest

from tests.bench.smoke import assert_finite, figures

# Four clusters and three redis-servers started and stopped: ~15-30 s on this 2-core machine.
# In tests/store/test_bulk.py's group: its nodes must not share the machine with that test.
pytestmark = [pytest.mark.redis_server, pytest.mark.slow, pytest.mark.xdist_group("redis-heavy")]

FIGURES = (
    "load_max_over_mean",
    "commands_max_over_mean",
    "cpu_max_over_mean",
    "cpu_us_per_token",
    "cpu_sys_share",
    "replica_cpu_us_per_token",
    "bytes_per_token",
    "net_in_bytes_per_token",
    "commands_per_token",
    "checkpoint_tokens_per_s",
    "submit_and_start_rollouts_per_s",
    "eval_wall_us_per_call",
    "xadd_wall_us_per_call",
    "appends_per_s_acks0",
    "appends_per_s_acks1",
    "replica_ack_cost_ratio",
    "commit_ms_acks0",
    "commit_ms_acks1",
    "single_redis_cpu_us_per_token",
    "cluster_over_single_cpu_ratio",
    "round_trips_per_commit",
    "round_trips_per_commit_per_master",
    "cpu_us_per_token_cluster_n1",
    "single_redis_cpu_us_per_token_n1",
    "cluster_over_single_cpu_ratio_n1",
    "cluster_n1_over_grouped_cpu_ratio",
    "lease_renew_us_per_worker_one_index",
    "lease_renew_us_per_worker_16_shards",
    "lease_renew_script_us_per_worker_one_index",
    "lease_renew_script_us_per_worker_16_shards",
    "lease_reap_us_per_pass_one_index",
    "lease_reap_us_per_pass_16_shards",
    "lease_16_shards_over_one_index_cpu_ratio",
    "lease_index_core_share_at_1000_workers",
    "lease_shard_core_share_at_1000_workers",
)


def test_a_small_run_reports_every_figure() -> None:
    result = figures(
        "bench_cluster.py", "--rollouts", "500", "--rounds", "1", "--commit", "128",
        "--commits", "2", "--ack-rounds", "2", "--fsync", "everysec", "--n1-rollouts", "500",
        "--n1-rounds", "1", "--lease-workers", "50", "--lease-rounds", "1", timeout=120,
    )  # fmt: skip
    assert_finite(result, FIGURES)
    assert all(result[name] > 0 for name in FIGURES)
    assert result["workload"]["group_size"] == 8 and result["lease_workers_measured"] == 50
    # A shard carries a sixteenth of the renewals and reaper reads, which together cost less
    # than 16 times the one index's (~2x measured).
    share = result["lease_shard_core_share_at_1000_workers"]
    assert share < result["lease_index_core_share_at_1000_workers"]
    # 128 rollouts (16 groups) of a checkpoint land on every master of 1, 3 and 6: one write
    # to each.
    sizes = result["round_trips_by_masters"]
    assert [s["masters"] for s in sizes] == [1, 3, 6]
    for s in sizes:
        assert s["masters_touched"] == s["masters"]
        assert s["round_trips_per_commit_per_master"] == 1.0
        assert s["round_trips_per_commit"] == s["masters"]
    assert result["round_trips_per_commit_per_master"] == 1.0
    # Every rollout's two keys on some master, the slot counters beside them.
    assert len(result["keys_per_master"]) == 3 and sum(result["rollouts_per_master"]) == 500
    assert sum(result["keys_per_master"]) >= 2 * 500
    assert 1.0 <= result["load_max_over_mean"] < 1.5
    assert result["tokens_stored"] == 500 * 16
    # A token's record is ~410 bytes (16 x 48 x 8 routes, ids, logprobs, versions).
    assert 300 < result["bytes_per_token"] < 2000
    rates = [row["tokens_per_s"] for row in result["table"]]
    assert rates == [100_000, 1_000_000, 10_000_000]
    for row in result["table"]:
        assert row["masters"] >= 1 and row["nodes"] == 2 * row["masters"]
        for value in row.values():
            assert math.isfinite(value) and value > 0, row
    masters = [row["masters"] for row in result["table"]]
    assert masters == sorted(masters)
