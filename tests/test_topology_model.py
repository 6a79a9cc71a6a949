"""The step model (`bench.step_model.topology`): the same rules for every arm (FSDP's all-gathers in
every FSDP arm, one efficiency per network), every input marked measured or assumed, the
frontier's bits, and the validation table computed from a recorded emulated-cluster run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench.step_model import topology as tm
from bench.lib.wire import MODEL_CONFIGS

# the emulated cluster's first run (`bench.cluster.emulated --paths ddp --layouts 2x2 --rates 87mbit,none
# --arms fp32,bf16,powersgd-4,muon-int2-leaky-ef,euclid-int2 --steps 8 --warmup 2`, under CPU contention;
# GIFT's exchange not yet overlapped, embedding and head at fp32), its records as that bench writes them
RECORDED = {
    "model": {"config": {"dim": 96, "n_layers": 42, "n_heads": 4, "vocab_size": 4096, "ffn_hidden": 256},
              "local_batch": 2, "seq_len": 64},
    "gift_overlapped": False, "unmapped_matrix_bytes": 4.0, "unmanaged_bytes": 4.0, "delay_ms": 0.0,
    "records": [
        {"arm": "fp32", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": 87000000.0, "warmup": 2, "steps": 8, "step_times": [6.531, 5.919, 6.782, 6.941, 7.075, 6.835, 6.813, 6.243, 6.309, 6.244], "link_bytes": [{"rx": 261820258, "tx": 261915652}, {"rx": 261916020, "tx": 261820250}]},
        {"arm": "bf16", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": 87000000.0, "warmup": 2, "steps": 8, "step_times": [5.518, 5.159, 4.725, 5.849, 4.793, 5.256, 5.114, 4.857, 5.131, 4.891], "link_bytes": [{"rx": 130908912, "tx": 131003614}, {"rx": 130997540, "tx": 130908860}]},
        {"arm": "powersgd-4", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": 87000000.0, "warmup": 2, "steps": 8, "step_times": [6.445, 5.835, 3.484, 3.767, 3.756, 3.355, 3.377, 3.307, 3.253, 3.388], "link_bytes": [{"rx": 16924178, "tx": 17019312}, {"rx": 17019312, "tx": 16924178}]},
        {"arm": "muon-int2-leaky-ef", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": 87000000.0, "warmup": 2, "steps": 8, "step_times": [11.424, 13.67, 17.023, 15.861, 16.299, 20.159, 16.934, 18.692, 17.894, 57.057], "link_bytes": [{"rx": 53014914, "tx": 53188226}, {"rx": 53188726, "tx": 53015164}]},
        {"arm": "euclid-int2", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": 87000000.0, "warmup": 2, "steps": 8, "step_times": [14.671, 18.168, 16.965, 15.893, 12.834, 12.877, 13.814, 12.884, 14.128, 15.523], "link_bytes": [{"rx": 36101948, "tx": 36204328}, {"rx": 36204468, "tx": 36101922}]},
        {"arm": "fp32", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": None, "warmup": 2, "steps": 8, "step_times": [3.228, 3.729, 3.004, 3.155, 3.375, 3.613, 3.765, 4.37, 3.901, 4.083], "link_bytes": [{"rx": 261677192, "tx": 261741724}, {"rx": 261741194, "tx": 261676424}]},
        {"arm": "bf16", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": None, "warmup": 2, "steps": 8, "step_times": [3.104, 3.103, 3.136, 3.896, 3.195, 3.218, 3.032, 3.102, 3.013, 3.641], "link_bytes": [{"rx": 130786166, "tx": 130884438}, {"rx": 130884780, "tx": 130786280}]},
        {"arm": "powersgd-4", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": None, "warmup": 2, "steps": 8, "step_times": [3.291, 3.856, 3.864, 3.69, 3.492, 3.529, 3.315, 3.418, 3.685, 3.904], "link_bytes": [{"rx": 16929054, "tx": 17024962}, {"rx": 17024602, "tx": 16928532}]},
        {"arm": "muon-int2-leaky-ef", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": None, "warmup": 2, "steps": 8, "step_times": [14.488, 14.223, 13.44, 14.202, 14.443, 17.116, 17.908, 24.154, 21.499, 64.354], "link_bytes": [{"rx": 52998390, "tx": 53179150}, {"rx": 53179786, "tx": 52999044}]},
        {"arm": "euclid-int2", "path": "ddp", "nodes": 2, "ranks_per_node": 2, "rate_bps": None, "warmup": 2, "steps": 8, "step_times": [16.312, 20.382, 23.16, 18.059, 14.824, 14.534, 13.013, 18.093, 16.673, 15.611], "link_bytes": [{"rx": 36089282, "tx": 36185372}, {"rx": 36185578, "tx": 36089256}]},
    ],
}


@pytest.fixture(scope="module")
def inputs() -> dict:
    return tm.load_inputs()


@pytest.fixture(scope="module")
def pricer(inputs: dict) -> tm.CodecPricer:
    return tm.CodecPricer(tm.load_bodies(tm.ROOT / inputs["global"]["codec_bodies"]["value"]))


def _entry(inputs: dict, name: str) -> dict:
    return copy.deepcopy(next(e for e in inputs["networks"] if e["name"] == name))


def test_every_input_is_marked_and_an_unmarked_one_raises(inputs: dict) -> None:
    marked = tm._inputs(inputs)
    assert len(marked) > 30
    for where, e in marked:
        assert (e["kind"], bool(e.get("command") if e["kind"] == "measured" else e.get("source"))) in (
            ("measured", True), ("assumed", True)), where
    bad = copy.deepcopy(inputs)
    bad["networks"][0]["latency_us"] = {"value": 10.0}
    with pytest.raises(ValueError, match=r"networks\[0\]\.latency_us"):
        tm.check_marked(bad)
    bad["networks"][0]["latency_us"] = {"value": 10.0, "kind": "measured"}  # measured, but by no command
    with pytest.raises(ValueError, match="latency_us"):
        tm.check_marked(bad)


def test_every_fsdp_arm_pays_the_parameter_allgathers(inputs: dict, pricer: tm.CodecPricer) -> None:
    """Forward and backward all-gathers at the param dtype, over the network for flat FSDP and
    inside the node for HSDP; more parameter bytes make every FSDP arm slower on a slow link."""
    x = inputs["global"]
    entry = _entry(inputs, "25 GbE per node")
    bits = {"gift": 2.25, "euclid": 2.25}
    arms = tm.price_all("Llama-600M", entry, 8, bits, x, inputs["gpus"], inputs["models"], pricer, "nvfp4")
    net = tm.network(entry, 8)
    sh = tm.shapes(MODEL_CONFIGS["Llama-600M"], 16384, 50, 32)
    pbytes = x["param_bytes_allgathered"]["value"] * sh.params
    heavier = dict(x, param_bytes_allgathered={"value": 4.0})
    arms4 = tm.price_all("Llama-600M", entry, 8, bits, heavier, inputs["gpus"], inputs["models"], pricer, "nvfp4")
    fsdp = [a for a, s in tm.ARMS.items() if s.layout in ("fsdp", "hsdp")]
    assert len(fsdp) == 9 and all(tm.ARMS[a].allgathers for a in fsdp)
    for a in fsdp:
        want = 2 * (tm._ring(pbytes, net, sh.n_layers + 1) if tm.ARMS[a].layout == "fsdp"
                    else tm._ring_in_node(pbytes, net))
        assert arms[a]["allgather"] == pytest.approx(want), a
        assert arms4[a]["step"] > arms[a]["step"], a
    assert arms["PowerSGD (DDP)"]["allgather"] == 0 and arms4["PowerSGD (DDP)"]["step"] == arms["PowerSGD (DDP)"]["step"]
    # at bf16 the two all-gathers move twice the bf16 ring reduce-scatter's bytes over the network
    assert arms["bf16 ring"]["allgather"] == pytest.approx(2 * arms["bf16 ring"]["link"], rel=1e-9)


def test_rings_and_all_to_alls_on_one_network_read_one_efficiency(inputs: dict, pricer: tm.CodecPricer) -> None:
    """Scale the network's one efficiency by 1/2 (no latency, no NVLink limit, no compute):
    every arm's network time doubles exactly; an arm with its own efficiency would not."""
    x = inputs["global"]
    models = copy.deepcopy(inputs["models"])
    models["Llama-3-8B"]["mfu"]["value"] = 1e12  # compute ~0: the step is the communication
    x0 = dict(x, gift_exchange_overlapped={"value": False})
    entry = _entry(inputs, "InfiniBand/RoCE 400 Gb/s per GPU")
    entry["latency_us"]["value"] = 0.0
    entry["fast_gbytes"]["value"] = 1e12
    half = copy.deepcopy(entry)
    half["efficiency"]["value"] = {k: v / 2 for k, v in entry["efficiency"]["value"].items()}
    bits = {"gift": 2.25, "euclid": 3.25}
    for nodes in (8, 64):
        a = tm.price_all("Llama-3-8B", entry, nodes, bits, x0, inputs["gpus"], models, pricer, "nvfp4")
        b = tm.price_all("Llama-3-8B", half, nodes, bits, x0, inputs["gpus"], models, pricer, "nvfp4")
        for arm in tm.ARMS:
            if tm.ARMS[arm].layout != "hsdp":  # HSDP's all-gathers stay on NVLink (priced at ~0 here)
                assert b[arm]["allgather"] == pytest.approx(2 * a[arm]["allgather"], rel=1e-9), arm
            assert b[arm]["link"] == pytest.approx(2 * a[arm]["link"], rel=1e-9), arm


def test_gpus_per_node_is_an_input(inputs: dict, pricer: tm.CodecPricer) -> None:
    """The same NIC rate per GPU with 4 or 8 GPUs per node: the two-level exchange's node chunk and
    the flat all-to-all's off-node share follow g (nothing assumes 8)."""
    x = inputs["global"]
    e8 = _entry(inputs, "100 GbE per node")
    e8["latency_us"]["value"] = 0.0
    e4 = copy.deepcopy(e8)
    e4["gpus_per_node"]["value"] = 4
    n8, n4 = tm.network(e8, 8), tm.network(e4, 16)
    assert (n8.world, n4.world, n8.nic) == (64, 64, n4.nic)
    # a node's 1/g chunk across n nodes: (1/g) (n-1)/n of the codes per GPU
    assert tm._across(1e9 / 4, n4, 1, False) / tm._across(1e9 / 8, n8, 1, False) == pytest.approx(
        (15 / 16 / 4) / (7 / 8 / 8))
    # a flat all-to-all: (W-g)/W of the codes leave the node
    assert tm._a2a(1e9, n4, 1) / tm._a2a(1e9, n8, 1) == pytest.approx((60 / 64) / (56 / 64))
    bits = {"gift": 2.25, "euclid": 2.25}
    a8 = tm.price_all("Llama-600M", e8, 8, bits, x, inputs["gpus"], inputs["models"], pricer, "nvfp4")
    a4 = tm.price_all("Llama-600M", e4, 16, bits, x, inputs["gpus"], inputs["models"], pricer, "nvfp4")
    assert a4["GIFT two-level"]["link"] > a8["GIFT two-level"]["link"]


def test_overlap_hides_communication_behind_the_backward_except_its_tail() -> None:
    assert tm._phase(1.0, 0.5, 10) == pytest.approx(1.05)  # compute-bound: the last unit's communication
    assert tm._phase(1.0, 3.0, 10) == pytest.approx(3.1)  # link-bound: the first unit's compute
    assert tm._phase(1.0, 0.5, 10, overlapped=False) == pytest.approx(1.5)
    assert tm._pipelined(2.0, 1.0, 4) == pytest.approx(2.25)  # the slower stage plus one bucket of the faster


def test_the_bits_come_from_the_frontier() -> None:
    frontier = json.loads((tm.RESULTS / "convergence" / "frontier.json").read_text())
    fb = tm.bits_from_frontier(frontier)
    arms = {a["arm"]: a for a in frontier["optimizers"]["muon"]["arms"]}
    for who in ("gift", "euclid"):
        assert arms[fb[who]["arm"]]["within"] and fb[who]["bits"] == arms[fb[who]["arm"]]["bits_managed"]
    assert fb["gift"]["bits"] < fb["euclid"]["bits"]  # GIFT reaches fp32's noise with fewer bits under Muon
    assert tm.format_bits({"format": "int2", "block_size": 32}) == pytest.approx(2.25, abs=0.01)


def test_the_validation_table_from_a_recorded_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v = tm.validate(RECORDED)
    rows = {r["arm"]: r for r in v["rows"]}
    assert set(rows) == {"fp32", "bf16", "powersgd-4", "euclid-int2", "muon-int2-leaky-ef"} and v["scored"] == 5
    assert v["gift_overlapped"] is False
    fp32 = rows["fp32"]
    # DDP's fp32 ring all-reduce over 2 nodes x 2: a node sends 2 (W-1)/W of the fp32 gradient;
    # the kernel counted that within 2% (for every native arm and the Euclidean one)
    sh = tm.shapes(tm.model_config(RECORDED), 128, 50, 32)
    assert sh.params == 5439456  # the bench's own count
    assert fp32["predicted_link_bytes"] == pytest.approx(1.5 * 4.0 * sh.params)
    for arm in ("fp32", "bf16", "powersgd-4", "euclid-int2"):
        assert rows[arm]["predicted_link_bytes"] == pytest.approx(rows[arm]["counted_link_bytes"], rel=0.02), arm
    # DDP's buckets: 1 MB first, then the rest (25 MB cap) ready only at the backward's end
    rate = 87e6 / 8 * tm.TC_FRAME_EFFICIENCY
    c = fp32["unshaped_s"]
    shares = tm.ddp_shares(4.0 * sh.params, tm.load_inputs()["global"])
    assert len(shares) == 2
    assert fp32["predicted_s"] == pytest.approx(c / 3 + tm._phase(c * 2 / 3, fp32["predicted_link_bytes"] / rate, shares),
                                                rel=1e-3)
    # GIFT's exchange did not overlap in that code: its whole link time is added to the backward
    gift = rows["muon-int2-leaky-ef"]
    assert gift["predicted_s"] == pytest.approx(gift["unshaped_s"] + gift["predicted_link_bytes"] / rate, rel=1e-6)
    assert v["within"] == sum(abs(r["error"]) <= 0.15 for r in v["rows"])
    path = tmp_path / "emulated.json"
    path.write_text(json.dumps(RECORDED))
    assert tm.main(["--validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| ddp | 2x2 | 87 | fp32 |" in out and f"{v['within']} of 5 within 15%" in out
    # each measured median with its order-statistic CI over the timed steps, and whether the prediction is inside
    for r in v["rows"]:
        timed = sorted(next(x for x in RECORDED["records"] if x["arm"] == r["arm"] and x["rate_bps"])["step_times"][2:])
        assert (r["measured_lo"], r["measured_hi"]) == (timed[0], timed[-1])  # n = 8: the range (99.2% coverage)
        assert r["inside_ci"] == (timed[0] <= r["predicted_s"] <= timed[-1])
    assert f"{v['inside_ci']} of 5 inside the measured median's 95% CI" in out


def test_fsdp_paths_block_on_the_emulated_cluster_and_the_refresh_bytes_are_gifts_counted_ones() -> None:
    """HSDP on a CPU: FSDP2's exchange blocks the backward for every arm (EMULATED_OVERLAP), so a
    shaped run is its unshaped step plus its whole link time; a GIFT arm's refresh bytes come
    from its own counter (per rank, handed to cross-node collectives) and travel exposed."""
    sh = tm.shapes(tm.model_config(RECORDED), 128, 50, 32)
    x = tm.load_inputs()["global"]
    base = {"path": "hsdp", "nodes": 2, "g": 2, "delay_ms": 0.0, "warmup": 1, "steps": 4}
    unshaped = {**base, "arm": "fp32", "rate_mbit": None, "step_times": [9.0, 5.0, 5.0, 5.0, 5.0]}
    shaped = {**base, "arm": "fp32", "rate_mbit": 100, "step_times": [9.0, 6.0, 6.0, 6.0, 6.0]}
    rate = 100e6 / 8 * tm.TC_FRAME_EFFICIENCY
    p = tm.predict_emulated(shaped, unshaped, sh, x, overlapped=True)
    assert p["overlapped"] is False
    assert p["predicted_link_bytes"] == pytest.approx(4.0 * sh.params)  # each rank's 1/2 shard, 2 (n-1)/n
    assert p["predicted_s"] == pytest.approx(5.0 + p["predicted_link_bytes"] / rate)
    ddp = tm.predict_emulated({**shaped, "path": "ddp"}, {**unshaped, "path": "ddp"}, sh, x, overlapped=True)
    assert ddp["overlapped"] is True and ddp["predicted_s"] < 5.0 + ddp["predicted_link_bytes"] / rate
    gift = {**base, "arm": "euclid-int2", "rate_mbit": 100, "step_times": [9.0] + [6.0] * 4,
            "gift_bytes": {"refresh_cross_wire": 8e6}}
    with_refresh = tm.predict_emulated(gift, {**gift, "rate_mbit": None}, sh, x, overlapped=True)
    without = tm.predict_emulated({**gift, "gift_bytes": {}}, {**gift, "rate_mbit": None}, sh, x, overlapped=True)
    assert tm.refresh_link_bytes(gift) == pytest.approx(2 * 8e6 / 2 / 4)  # g ranks, (n-1)/n, per timed step
    assert with_refresh["predicted_link_bytes"] - without["predicted_link_bytes"] == pytest.approx(2e6)
    assert with_refresh["predicted_s"] - without["predicted_s"] == pytest.approx(2e6 / rate)


def test_counted_link_bytes_are_per_node_and_timed_step() -> None:
    run = copy.deepcopy(RECORDED)
    shaped = run["records"][0]
    assert shaped["arm"] == "fp32" and shaped["rate_bps"]
    shaped.update(step_times=[9.0, 1.4, 1.4, 1.4], warmup=1, steps=3,
                  link_bytes=[{"tx": 30e6, "rx": 33e6}, {"tx": 36e6, "rx": 30e6}])  # made up: the arithmetic only
    row = next(r for r in tm.validate(run)["rows"] if r["arm"] == "fp32")
    assert row["counted_link_bytes"] == pytest.approx(11e6) and row["measured_s"] == 1.4


def test_a_results_json_without_its_layout_or_model_raises() -> None:
    bad = copy.deepcopy(RECORDED)
    del bad["records"][0]["nodes"]
    with pytest.raises(ValueError, match="layout"):
        tm.validate(bad)
    with pytest.raises(ValueError, match="model"):
        tm.validate({"records": RECORDED["records"]})


def test_the_committed_result_has_every_arm_setting_and_the_paper() -> None:
    d = json.loads(tm.OUT.read_text())
    assert {r["setting"] for r in d["rows"]} == {"equal bits", "equal quality"}
    assert {r["model"] for r in d["rows"]} == set(tm.MODELS)
    assert {r["gpus_per_node"] for r in d["rows"]} == {4, 8}
    for r in d["rows"]:
        assert set(r["arms"]) == set(tm.ARMS)
        assert all(a["allgather"] > 0 for n, a in r["arms"].items() if tm.ARMS[n].allgathers)
    p = d["paper"]
    assert (p["model"], p["nodes"] * p["gpus_per_node"]) == ("Llama-600M", 64)
    assert p["paper_gift_vs_fp32"] == -0.076 and p["paper_euclid_vs_fp32"] == -0.108
    text = tm.when_it_pays()
    assert "the paper's setting" in text and "-7.6%" in text
