"""bench.convergence.frontier: the judgement "within fp32's CI" and the bits axis, on synthetic run records
whose answers are known (the committed tables themselves are checked by test_bench_readme)."""

import json
import math

import pytest

from bench.convergence import frontier
from bench.pages import frontier as pages_frontier
from bench.lib.stats import t_quantile

MANAGED = 1000
FP32 = [2.70, 2.71, 2.72, 2.73, 2.74]  # fp32's spread: band = t(0.975, 4) * sd / sqrt(5)


def _run(opt: str, arm: str, seed: int, bpb: float, bits: float = 32.0) -> dict:
    """A record as bench.convergence.runner writes it; unmanaged gradient: 500 fp32 elements."""
    base = 4.0 * (MANAGED + 500)
    wire = 4.0 * 500 + bits * MANAGED / 8.0
    rec = {"optimizer": opt, "arm": arm, "seed": seed, "path": "reduce-scatter", "world": 2, "steps": 120,
           "losses": [0.0] * 120, "evals": [[120, bpb]], "seconds": 1.0}
    if arm != "fp32":
        rec.update(wire_bytes_per_step=wire, baseline_bytes_per_step=base, managed_elements=MANAGED)
    return rec


def _runs(gaps: dict[str, tuple[list[float], float]]) -> list[dict]:
    out = [_run("muon", "fp32", s, v) for s, v in enumerate(FP32)]
    for arm, (diffs, bits) in gaps.items():
        out += [_run("muon", arm, s, FP32[s] + d, bits) for s, d in enumerate(diffs)]
    return out


def test_within_needs_the_adjusted_upper_bound_inside_fp32s_band():
    band = t_quantile(0.975, 4) * 0.01 * math.sqrt(2.5) / math.sqrt(5)  # sd of FP32 = 0.0158
    small = [0.001, 0.002, 0.0015, 0.0012, 0.0018]  # far inside
    big = [band * 0.9 + e for e in (0.0, 0.002, -0.002, 0.001, -0.001)]  # mean inside, upper bound outside
    s = frontier.summarise(_runs({"euclid-int3": (small, 3.25), "gift-int2-dflt": (big, 2.25),
                                  "gift-int3-dflt": (small[:3], 3.25)}))
    o = s["optimizers"]["muon"]
    assert o["fp32"]["band95"] == pytest.approx(band, rel=1e-6)
    arms = {a["arm"]: a for a in o["arms"]}
    assert arms["euclid-int3"]["within"] and not arms["gift-int2-dflt"]["within"]
    assert not arms["gift-int3-dflt"]["judged"] and "within" not in arms["gift-int3-dflt"]  # n=3 < 5
    assert o["family_size"] == 2  # Bonferroni over the judged arms only
    t_adj = t_quantile(1 - 0.05 / 4, 4)
    g = arms["gift-int2-dflt"]["gap"]
    assert arms["gift-int2-dflt"]["upper_adjusted"] == pytest.approx(g["mean"] + t_adj * g["std"] / math.sqrt(5))
    assert o["fewest_within"] == {m: "euclid-int3" if m == "Euclidean" else None for m in frontier.METHODS}


def test_bits_come_from_the_byte_counters_and_fewest_bits_wins():
    tiny = [0.0, 0.0005, -0.0005, 0.0002, -0.0002]
    s = frontier.summarise(_runs({"gift-int3-dflt": (tiny, 3.25), "gift-int2-dflt": (tiny, 2.25),
                                  "euclid-int3": (tiny, 3.25)}))
    o = s["optimizers"]["muon"]
    arms = {a["arm"]: a for a in o["arms"]}
    assert arms["gift-int2-dflt"]["bits_managed"] == pytest.approx(2.25)
    assert arms["gift-int2-dflt"]["bits_whole"] == pytest.approx(32 * (2000 + 2.25 * MANAGED / 8) / 6000)
    assert o["fewest_within"]["GIFT (defaults)"] == "gift-int2-dflt"
    assert o["shift_bits"]["GIFT (defaults) vs Euclidean"] == pytest.approx(1.0)


def test_runs_of_another_design_are_not_paired():
    runs = _runs({"euclid-int3": ([0.001] * 5, 3.25)})
    other = [dict(r, world=4) for r in _runs({"gift-int3-dflt": ([0.0] * 5, 3.25)}) if r["arm"] != "fp32"]
    s = frontier.summarise(runs + other)
    assert [a["arm"] for a in s["optimizers"]["muon"]["arms"]] == ["euclid-int3"]


def test_ranks_pairs_each_rank_count_with_its_own_fp32_and_the_change_by_seed(tmp_path):
    """2 vs 4 ranks: each gap is taken against fp32 at the same rank count (a 4-rank fp32 that
    differs from the 2-rank one must not leak into the 2-rank gap), the change is paired by seed,
    and an arm with runs at only one rank count is left out."""
    lines = []
    for seed in range(5):
        for world, fp32 in ((2, 2.70), (4, 2.60)):
            lines.append({**_run("muon", "fp32", seed, fp32 + 0.001 * seed), "world": world})
            lines.append({**_run("muon", "euclid-int2", seed, fp32 + 0.001 * seed + (0.02 if world == 2 else 0.01)
                                 + 0.0001 * seed), "world": world, "selected_layers": 0})
        lines.append({**_run("muon", "gift-int2", seed, 2.71), "world": 2})  # no 4-rank run
    f = tmp_path / "runs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = frontier.ranks((f,), priced=tmp_path / "none.jsonl")
    assert [a["arm"] for a in out["arms"]] == ["euclid-int2"]
    a = out["arms"][0]
    assert a["gap2"]["mean"] == pytest.approx(0.0202) and a["gap4"]["mean"] == pytest.approx(0.0102)
    assert a["change"]["mean"] == pytest.approx(-0.01) and a["change_resolved_holm"] and a["selected4"] == 0


def test_the_priced_defaults_reuse_two_rank_runs_only_where_seed_0_reproduced_them(tmp_path):
    """The defaults under the priced cost side are read from their own file under their own
    name; their 2-rank gap borrows the former defaults' runs only if their seed-0 run at 2 ranks
    has the same loss curve, and the layers each rule transformed are listed per rank count."""
    before, after = [], []
    for seed in range(3):
        for world, fp32 in ((2, 2.70), (4, 2.60)):
            before.append({**_run("muon", "fp32", seed, fp32 + 0.001 * seed), "world": world})
        before.append({**_run("muon", "gift-int2-dflt", seed, 2.72 + 0.001 * seed), "world": 2, "selected_layers": 28})
        before.append({**_run("muon", "gift-int2-dflt", seed, 2.62 + 0.003 * seed), "world": 4, "selected_layers": 0})
        after.append({**_run("muon", "gift-int2-dflt", seed, 2.61 + 0.0015 * seed), "world": 4, "selected_layers": 28})
        before.append({**_run("muon", "euclid-int2", seed, 2.62 + 0.003 * seed), "world": 4, "selected_layers": 0})
    same = {**_run("muon", "gift-int2-dflt", 0, 2.72), "world": 2, "selected_layers": 28}
    f, g = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in before) + "\n")
    g.write_text("\n".join(json.dumps(r) for r in after) + "\n")
    assert frontier.PRICED_ARM not in [a["arm"] for a in frontier.ranks((f,), priced=g)["arms"]]  # no 2-rank run
    g.write_text("\n".join(json.dumps(r) for r in [*after, {**same, "losses": [1.0] * 120}]) + "\n")
    out = frontier.ranks((f,), priced=g)
    assert not out["priced_reuses_two_rank_runs"] and frontier.PRICED_ARM not in [a["arm"] for a in out["arms"]]
    g.write_text("\n".join(json.dumps(r) for r in [*after, same]) + "\n")
    out = frontier.ranks((f,), priced=g)
    assert out["priced_reuses_two_rank_runs"]
    rows = {a["arm"]: a for a in out["arms"]}
    priced, former = rows[frontier.PRICED_ARM], rows["gift-int2-dflt"]
    assert priced["gap2"] == former["gap2"] and priced["selected4"] == 28 and former["selected4"] == 0
    assert priced["gap4"]["mean"] == pytest.approx(0.01 + 0.0005)
    versus = {(v["arm"], v["world"]): v for v in out["versus_euclid"]}
    assert set(versus) == {("gift-int2-dflt", 4), (frontier.PRICED_ARM, 4)}  # no Euclidean run at 2 ranks
    assert versus[("gift-int2-dflt", 4)]["minus_euclid"]["mean"] == pytest.approx(0.0)
    assert versus[(frontier.PRICED_ARM, 4)]["minus_euclid"]["mean"] == pytest.approx(-0.01 - 0.0015)
    assert {(x["arm"], x["world"]): x["selected"] for x in out["layers"]} == {
        ("gift-int2-dflt", 2): 28, ("gift-int2-dflt", 4): 0, (frontier.PRICED_ARM, 2): 28, (frontier.PRICED_ARM, 4): 28}


def test_a_rank_count_run_on_one_seed_is_shown_without_a_ci_and_stays_out_of_holm(tmp_path):
    """At 8 ranks the defaults, fp32 and Euclidean int2 may have one seed: the row is listed with
    its point estimate, is not tested, and does not enlarge the family of the tested rows (a 4-rank
    difference with p just under 5% stays resolved, as it would alone)."""
    runs, priced = [], []
    for seed, spread in enumerate((0.007, -0.007, 0.007, -0.007, 0.0)):  # GIFT minus Euclidean: p = 0.033
        runs.append({**_run("muon", "fp32", seed, 2.60), "world": 4})
        runs.append({**_run("muon", "euclid-int2", seed, 2.62), "world": 4})
        priced.append({**_run("muon", "gift-int2-dflt", seed, 2.61 + spread), "world": 4, "selected_layers": 28})
    runs += [{**_run("muon", "fp32", 0, 2.50), "world": 8}, {**_run("muon", "euclid-int2", 0, 2.52), "world": 8}]
    priced.append({**_run("muon", "gift-int2-dflt", 0, 2.515), "world": 8, "selected_layers": 28})
    f, g = tmp_path / "runs.jsonl", tmp_path / "priced.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    g.write_text("\n".join(json.dumps(r) for r in priced) + "\n")
    versus = {v["world"]: v for v in frontier.ranks((f,), priced=g)["versus_euclid"]}
    one = versus[8]
    assert one["seeds"] == [0] and one["minus_euclid"]["n"] == 1 and not one["resolved_holm"]
    assert one["minus_euclid"]["mean"] == pytest.approx(-0.005)
    four = versus[4]["minus_euclid"]
    assert 0.025 < four["p"] < 0.05 and versus[4]["resolved_holm"]  # alone in the family: not held to 2.5%
    page = "\n".join(pages_frontier._frontier_ranks({**frontier.ranks((f,), priced=g), "arms": [{
        "arm": "x", "gap2": four, "gap4": four, "change": four, "change_resolved_holm": False,
        "selected2": None, "selected4": None}]}))
    assert "| gift-int2-dflt-priced | 8 | +0.0150 (one seed, no CI) | -0.0050 (one seed, no CI) | not tested (n=1) |" \
        in page, page


def test_alternatives_hold_gifts_best_to_the_best_euclidean_arm_at_the_same_bits():
    """Per format, each side's arm with the smallest mean gap (n >= 5) is taken, the two are
    differenced seed by seed, Holm runs over the comparisons made, a format without both sides
    is listed as not compared, and the bf16 bar's bits divide GIFT's."""
    runs = _runs({
        "euclid-int2": ([0.030, 0.031, 0.029, 0.030, 0.032], 2.25),
        "euclid-int2-ef-b9-rot": ([0.012, 0.013, 0.011, 0.012, 0.0125], 2.25),  # the best Euclidean
        "gift-int2-dflt": ([0.020, 0.021, 0.019, 0.020, 0.022], 2.25),
        "gift-int2-ef-b9-dflt": ([0.006, 0.0065, 0.0055, 0.006, 0.007], 2.25),  # the best GIFT
        "gift-int2-ef-b9-dflt-rot": ([0.001] * 3, 2.25),  # n=3: not a candidate
        "gift-int3-dflt": ([0.004] * 5, 3.25),
        "euclid-bf16": ([0.0, 0.0001, -0.0001, 0.0, 0.0], 16.0),
    })
    summary = frontier.summarise(runs)
    alt = frontier.alternatives(summary, runs)
    rows = {r["format"]: r for r in alt["rows"]}
    int2 = rows["int2"]
    assert (int2["gift"], int2["euclid"]) == ("gift-int2-ef-b9-dflt", "euclid-int2-ef-b9-rot")
    want = [g - e for g, e in zip([0.006, 0.0065, 0.0055, 0.006, 0.007], [0.012, 0.013, 0.011, 0.012, 0.0125])]
    assert int2["difference"]["mean"] == pytest.approx(sum(want) / 5) and int2["resolved_holm"]
    assert int2["fewer_bits_than_bar"] == pytest.approx(16 / 2.25)
    assert not rows["int3"]["compared"] and rows["int3"]["candidates"]["Euclidean"] == []
    assert alt["family_size"] == 1 and alt["bar"]["muon"]["arm"] == "euclid-bf16"


def test_techniques_pair_each_arm_with_the_arm_it_modifies(tmp_path):
    """A technique is kept only where its change against the arm it modifies (same seeds) is
    resolved after Holm and negative; one that is resolved but worse is not; an arm with one
    seed is left out; each technique arm's own gap is judged against fp32's band."""
    gaps = {"gift-int2-ef-b9-dflt": ([0.010, 0.011, 0.012, 0.010, 0.011], 2.25),
            "euclid-int2": ([0.020, 0.021, 0.019, 0.020, 0.022], 2.25)}
    runs = _runs(gaps)
    # rotation helps GIFT clearly (-0.008 each seed), hurts Euclidean clearly (+0.005)
    runs += [_run("muon", "gift-int2-ef-b9-dflt-rot", s, FP32[s] + d - 0.008 - 0.0001 * s, 2.25)
             for s, d in enumerate(gaps["gift-int2-ef-b9-dflt"][0])]
    runs += [_run("muon", "euclid-int2-rot", s, FP32[s] + d + 0.005 + 0.0001 * s, 2.25)
             for s, d in enumerate(gaps["euclid-int2"][0])]
    runs.append(_run("muon", "gift-int2-ef-b9-dflt-alloc", 0, FP32[0] + 0.01, 2.2))  # one seed: left out
    f = tmp_path / "runs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    summary = frontier.summarise(runs)
    out = frontier.techniques(summary, (f,))
    rows = {a["arm"]: a for a in out["arms"]}
    assert set(rows) == {"gift-int2-ef-b9-dflt-rot", "euclid-int2-rot"}
    gift, euclid = rows["gift-int2-ef-b9-dflt-rot"], rows["euclid-int2-rot"]
    assert gift["change"]["mean"] == pytest.approx(-0.0082) and gift["kept"]
    assert euclid["change_resolved_holm"] and not euclid["kept"]
    assert out["family_size"] == summary["optimizers"]["muon"]["family_size"] + 2
    assert gift["within"] == (gift["upper_adjusted"] <= summary["optimizers"]["muon"]["fp32"]["band95"])


def test_recipes_are_the_committed_frontiers_fewest_bits():
    """`adamw-int3` and `muon-int2-leaky-ef` name the configuration the README's frontier
    headline recommends per optimizer (the committed `bench/results/convergence/frontier.json`): a re-run
    that moves the frontier fails here until the recipe follows."""
    import json

    from bench.pages.frontier import FRONTIER, best_arms, config_kwargs
    from gift_compile.recipes import RECIPES, recipe, recipe_fields

    best = best_arms(json.loads(FRONTIER.read_text()))
    for name in ("adamw-int3", "muon-int2-leaky-ef"):
        fields = recipe_fields(name)
        fields.pop("geometry")  # "auto": the frontier's GIFT arms ran the defaults with optimizer=
        assert fields == config_kwargs(best[RECIPES[name].optimizer]), name
        assert "GIFT" in best[RECIPES[name].optimizer]["method"]
        cfg = recipe(name, seed=3)
        assert cfg.seed == 3 and all(getattr(cfg, k) == v for k, v in fields.items())


def test_the_long_horizon_pairs_each_arm_with_fp32_of_the_same_length(tmp_path):
    """480-step arms are paired with the 480-step fp32 of the same seed (never the 120-step
    one), and GIFT minus Euclidean is differenced seed by seed."""
    gift, euclid = frontier.LONG_ARMS
    rows = []
    for seed in range(3):
        rows.append({**_run("muon", "fp32", seed, 2.50 + 0.01 * seed), "steps": 480})
        rows.append(_run("muon", "fp32", seed, 9.0))  # 120 steps: must not be paired
        rows.append({**_run("muon", gift, seed, 2.505 + 0.01 * seed + 0.0001 * seed), "steps": 480})
        if seed < 2:
            rows.append({**_run("muon", euclid, seed, 2.51 + 0.01 * seed), "steps": 480})
    f = tmp_path / "long.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = frontier.long_horizon((f,))
    assert out["arms"][gift]["n"] == 3 and out["arms"][gift]["gap"]["mean"] == pytest.approx(0.005 + 0.0001)
    assert out["arms"][euclid]["n"] == 2 and out["difference_seeds"] == [0, 1]
    assert out["difference"]["mean"] == pytest.approx(-0.005 + 0.00005)


def test_the_headline_names_each_bit_widths_verdict_against_the_best_euclidean_arm():
    """The README bullet's per-width clause is read off the alternatives rows' Holm verdicts
    (better, worse, unresolved, and a width not compared is left out), not typed in."""
    def row(fmt: str, mean: float | None, resolved: bool = False) -> dict:
        if mean is None:
            return {"optimizer": "muon", "format": fmt, "compared": False}
        return {"optimizer": "muon", "format": fmt, "compared": True, "euclid": f"euclid-{fmt}-ef-b9-rot",
                "gift": f"gift-{fmt}-dflt", "resolved_holm": resolved,
                "difference": {"mean": mean, "ci95": 0.001, "n": 5}}
    f = {"alternatives": {"rows": [row("int3", -0.002, True), row("int2b16", 0.003, True), row("int2", -0.001),
                                   row("int4", None)], "bar": {}, "family_size": 3}}
    text = pages_frontier._against_alternative(f, "muon", {"format": "int3", "bits_managed": 3.25})
    assert ("Per bit width against the best Euclidean arm (same test): int3 GIFT better, "
            "int2b16 Euclidean better, int2 not resolved.") in text
    assert "int4" not in text and "resolved at Holm 5% over 3 comparisons" in text


def _ar(opt: str, arm: str, seed: int, bpb: float, **extra) -> dict:
    return {**_run(opt, arm, seed, bpb), "path": "all-reduce", **extra}


def _psgd(bits: float) -> dict:
    return {"powersgd": {"bits_managed_compressed": bits, "bits_managed": bits + 3.0, "bits_whole_compressed": bits / 2,
                         "start_iter": 12, "min_compression_rate": 2, "matrices": {"a": {}}}}


def test_powersgd_pairs_each_rank_with_gifts_nearest_bits_and_judges_only_n5(tmp_path):
    """PowerSGD rank 4 (~1 bit) and 16 (~4 bits) against GIFT's all-reduce arms: each paired with the
    arm at the nearest bits (int2 at 3.4 for both: nvfp4 at 6.8 is farther), GIFT minus PowerSGD by
    seed; the rank run on 3 seeds is shown with its n and never resolved; fp32-ddp's check."""
    runs = [_ar("muon", "fp32", s, v) for s, v in enumerate(FP32)]
    runs += [_ar("muon", "fp32-ddp", 0, FP32[0])]
    for arm, bits, cost in (("gift-int2", 3.4, 0.010), ("gift-int2-ef", 3.4, 0.012), ("gift-nvfp4", 6.8, 0.002)):
        runs += [{**_run("muon", arm, s, FP32[s] + cost + 0.0001 * s, bits), "path": "all-reduce"} for s in range(5)]
    runs += [_ar("muon", "powersgd-r4", s, FP32[s] + 0.03 + 0.0002 * (s % 2), **_psgd(1.08)) for s in range(5)]
    runs += [_ar("muon", "powersgd-r16", s, FP32[s] + 0.005, **_psgd(4.3)) for s in range(3)]
    f = tmp_path / "runs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in runs))
    p = frontier.powersgd(MANAGED, (f,))
    rows = {r["rank"]: r for r in p["rows"]}
    assert rows[4]["gift"]["arm"] == "gift-int2" and rows[16]["gift"]["arm"] == "gift-int2"  # nearest, smallest gap
    assert rows[4]["bits_managed"] == pytest.approx(1.08) and rows[4]["bits_all_steps"] == pytest.approx(4.08)
    assert rows[4]["difference"]["mean"] == pytest.approx(0.010 + 0.0002 - 0.03 - 0.0002 * 2 / 5, abs=1e-4)
    assert rows[4]["judged"] and rows[4]["resolved_holm"]
    assert rows[16]["difference"]["n"] == 3 and not rows[16]["judged"] and not rows[16]["resolved_holm"]
    assert p["family_size"] == 1
    assert p["optimizers"]["muon"]["ddp_check"][0]["losses_identical"]
    text = "\n".join(pages_frontier._powersgd(p))
    assert "**GIFT better** (n=5)" in text and "not judged (n=3 < 5)" in text
    verdict = pages_frontier.powersgd_verdict(p)
    assert "Of 1 rows with n >= 5 (Holm 5%), GIFT better in 1, PowerSGD better in 0" in verdict


def test_two_level_and_larger_model_pair_within_their_own_designs(tmp_path):
    """Two levels: flat and `-2l` from their own file, fp32 from the 4-rank file, the change by seed;
    the larger model: only runs recorded with `model: x4`, resolved only with n >= 5."""
    def four(arm: str, s: int, bpb: float) -> dict:
        r = {**_run("muon", arm, s, bpb), "world": 4}
        if arm.endswith("-2l"):
            r["node_layout"] = {"nodes": 2, "ranks_per_node": 2}
        return r

    fp32 = tmp_path / "rs4.jsonl"
    fp32.write_text("".join(json.dumps(four("fp32", s, v)) + "\n" for s, v in enumerate(FP32)))
    mine = tmp_path / "two.jsonl"
    mine.write_text("".join(json.dumps(four(a, s, FP32[s] + c + 0.0001 * s * (a[-1] == "l"))) + "\n"
                            for s in range(5) for a, c in (("gift-int2-dflt", 0.010), ("gift-int2-dflt-2l", 0.012))))
    t = frontier.two_level(mine, fp32, tmp_path / "none.jsonl")
    (row,) = t["arms"]
    assert row["gap_flat"]["mean"] == pytest.approx(0.010) and row["change"]["mean"] == pytest.approx(0.0022)
    assert row["judged"] and row["resolved_holm"] and row["two_level_layouts"] == [(2, 2)]
    assert "**two levels cost loss** (n=5)" in "\n".join(pages_frontier._two_level(t))

    x4 = tmp_path / "x4.jsonl"
    recs = [{**_run("muon", a, s, FP32[s] + c + 0.001 * s * (a == "fp32")), "model": "x4", "model_params": 13_767_552}
            for s in range(4) for a, c in (("fp32", 0.0), *zip(frontier.LONG_ARMS, (0.001, 0.003)))]
    recs.append({**_run("muon", frontier.LONG_ARMS[0], 4, 9.0)})  # the small model's run: never read here
    x4.write_text("".join(json.dumps(r) + "\n" for r in recs))
    x = frontier.larger_model(x4)
    assert x["difference"]["n"] == 4 and x["difference"]["mean"] == pytest.approx(-0.002) and not x["resolved"]
    assert "not judged (n=4 < 5)" in "\n".join(pages_frontier._larger(x))


def test_whole_gradient_pairs_the_embeddings_format_with_bf16_and_bf16_with_raw(tmp_path):
    """The embedding and head at the layers' format (`-uw`), at bf16 (`-ubf`) and raw: gaps to fp32
    and both differences by seed, Holm over the two; bytes per step from the runs' counters."""
    base = frontier.WHOLE_BASE
    study = tmp_path / "study.jsonl"
    study.write_text("".join(json.dumps(r) + "\n" for r in _runs({base: ([0.004 + 0.0001 * s for s in range(5)], 2.25)})))
    mine = tmp_path / "whole.jsonl"
    mine.write_text("".join(json.dumps(_run("muon", a, s, FP32[s] + c + 0.0002 * s * (a[-1] == "w"), bits)) + "\n"
                            for s in range(5) for a, c, bits in ((f"{base}-uw", 0.010, 2.25), (f"{base}-ubf", 0.004, 4.0))))
    w = frontier.whole_gradient(mine, (study,))
    assert {k: a["n"] for k, a in w["arms"].items()} == {"format": 5, "bf16": 5, "fp32": 5}
    assert w["arms"]["format"]["gap"]["mean"] == pytest.approx(0.0104)
    fmt, bf16 = w["rows"]
    assert fmt["difference"]["mean"] == pytest.approx(0.0104 - 0.004) and fmt["judged"] and fmt["resolved_holm"]
    assert bf16["difference"]["mean"] == pytest.approx(-0.0002) and w["family_size"] == 2
    assert w["arms"]["bf16"]["wire_mb_per_step"] == pytest.approx((4.0 * 500 + 4.0 * MANAGED / 8) / 1e6)
    text = "\n".join(pages_frontier._whole_gradient(w))
    assert "| format minus bf16 | +0.0064" in text and "**the first costs loss** (n=5)" in text
    empty = frontier.whole_gradient(tmp_path / "none.jsonl", (study,))
    assert "no runs yet" in "\n".join(pages_frontier._whole_gradient(empty))
