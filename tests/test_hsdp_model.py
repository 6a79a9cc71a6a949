"""`bench.step_model.hsdp`: the per-hop projection prices each hop at its own format."""

from __future__ import annotations

import pytest

from bench.step_model import hsdp as hsdp_model


def test_each_hop_is_priced_at_its_own_format() -> None:
    out = hsdp_model.run(models=("Llama-600M",))
    rows = out["models"]["Llama-600M"]
    n, g = out["topology"]["nodes"], out["topology"]["gpus_per_node"]
    params = rows["HSDP fp32"]["network_bytes"] / (2 * (n - 1) / n * 4 / g)
    # fp32 HSDP: a ring all-reduce of every GPU's 1/g shard across nodes, a reduce-scatter inside
    assert rows["HSDP fp32"]["nvlink_bytes"] == pytest.approx((g - 1) / g * 4 * params)
    assert rows["FSDP fp32"]["network_bytes"] > 4 * rows["HSDP fp32"]["network_bytes"]
    # a per-hop precision changes only its own hop
    per_hop = rows["HSDP fp32 / nvfp4"]
    # (GIFT's fp32 shard hop adds its 16-byte headers per collective to the plain fp32 bytes)
    assert per_hop["nvlink_bytes"] == pytest.approx(rows["HSDP fp32"]["nvlink_bytes"], rel=1e-4)
    assert per_hop["network_bytes"] < rows["HSDP fp32"]["network_bytes"] / 3
    assert rows["HSDP fp8 / nvfp4"]["network_bytes"] == per_hop["network_bytes"]
    assert rows["HSDP fp8 / nvfp4"]["nvlink_bytes"] == rows["HSDP fp8 / fp8"]["nvlink_bytes"] < per_hop["nvlink_bytes"]
    for r in rows.values():
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_comm_s"] + r["codec_s"] + r["stats_s"]
                                            + r["refresh_s"])
