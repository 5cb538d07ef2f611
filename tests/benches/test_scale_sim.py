"""benches/scale_sim.py --hybrid: full sharding against HSDP on the planner's simulator."""

from __future__ import annotations

from scale_sim import hybrid_cost, simulate_hybrid


def test_hsdp_all_reduces_across_the_nodes_and_keeps_a_nodes_share_of_the_state():
    full, hsdp = simulate_hybrid("1b", 32)
    assert (full["layout"], hsdp["layout"]) == ("full", "hsdp")
    assert full["cost_model"]["world"] == 32 and "replicas" not in full["cost_model"]
    assert hsdp["cost_model"]["world"] == 8 and hsdp["cost_model"]["replicas"] == 4
    # the same model and micro-batch: the same compute; a rank keeps 4x the state of full's
    assert full["compute_ms"] == hsdp["compute_ms"]
    assert full["state_GiB"] > 0.1
    assert abs(hsdp["state_GiB"] - 4 * full["state_GiB"]) < 0.02 * hsdp["state_GiB"]
    # the all-reduce between nodes: 2 (r - 1) ring steps of the measured latency
    inter = hybrid_cost(32)["inter"]
    assert inter["bus_gbps"] == 50.0
    assert inter["latency_us"] == 6 * hybrid_cost(16)["inter"]["latency_us"] / 2
