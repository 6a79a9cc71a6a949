"""`make gpu-check`'s script in its CPU dry run: the code paths a GPU run takes, at toy sizes.

No GPU is needed: `--dry-run` compiles the same codec bodies with Inductor's CPU backend, counts
their kernels' bytes, times them and compares them with the eager CPU codec; the explicit
kernels' traffic is traced for CUDA on fake tensors, as on the GPU. The torchtitan
section is left out here (tests/test_torchtitan_train.py runs that launcher).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu import check as gpu_check


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    with pytest.MonkeyPatch.context() as mp:  # two codecs at one shape keep it to four compiles
        mp.setattr(gpu_check, "DRY_SHAPES", (("dry w2", 64, 192),))
        mp.setattr(gpu_check, "CODEC_PATHS", ("euclid-fp8", "gift-fp8"))
        code = gpu_check.main(["--dry-run", "--sections", "device,kernel_traffic,map,fold,codec,parity", "--out", str(out)])
    return code, json.loads((out / "gpu_check.json").read_text()), (out / "GPU.md").read_text()


def test_dry_run_succeeds_and_reports_every_section(dry_run: tuple[int, dict, str]) -> None:
    code, results, md = dry_run
    assert code == 0 and results["dry_run"]
    assert {k: v["status"] for k, v in results["sections"].items()} == {
        "device": "ok", "kernel_traffic": "ok", "map": "ok", "fold": "ok", "codec": "ok", "parity": "ok"}
    assert md.startswith("# GPU check (DRY RUN on the CPU")
    for heading in ("## Device", "## Kernel traffic", "## The low-rank map alone",
                    "## The projection folded into the weight-gradient matmul", "## Codec kernels",
                    "## Parity with the CPU"):
        assert heading in md


def test_codec_rows_hold_measured_bytes_and_times(dry_run: tuple[int, dict, str]) -> None:
    _, results, _ = dry_run
    copy_bw = results["sections"]["device"]["result"]["copy_bytes_per_s"]
    assert copy_bw > 1e8
    rows = {r["path"]: r for r in results["sections"]["codec"]["result"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["time_us"] > 0 and r["kernels"] >= 3
        assert r["impl"] == "inductor"  # the CPU compiles every step; the explicit kernels are CUDA's
        assert r["achieved_bytes_per_s"] == pytest.approx(r["bytes_per_element"] * 64 * 192 / (r["time_us"] / 1e6))
        assert r["fp8_types"] == ["at::Float8_e4m3fn"]  # the codes are E4M3, converted in the C++ kernels
        # the minimum is a lower bound of the generated traffic, priced at the measured copy bandwidth
        assert 0 < r["minimum_bytes_per_element"] <= r["bytes_per_element"]
        assert r["minimum_us"] == pytest.approx(r["minimum_bytes_per_element"] * 64 * 192 / copy_bw * 1e6)
        assert r["vs_minimum_time"] == pytest.approx(r["time_us"] / r["minimum_us"])
        # every generated C++ kernel is timed on its own (no bytes on the CPU: those come from Triton's metadata)
        assert len([k for k in r["per_kernel"] if "cpp_fused" in k["kernel"]]) >= 2
        assert all(k["us"] > 0 and k["bytes"] is None for k in r["per_kernel"])
    # the low-rank transform adds traffic (the projection matmul reads G; the expansion's output)
    assert rows["gift-fp8"]["bytes_per_element"] > rows["euclid-fp8"]["bytes_per_element"] > 10


def test_compiled_codec_matches_the_eager_cpu_codec(dry_run: tuple[int, dict, str]) -> None:
    _, results, _ = dry_run
    parity = results["sections"]["parity"]["result"]
    assert [r["path"] for r in parity] == ["euclid-fp8", "gift-fp8"]
    assert all(r["differ"] == 0 and r["elements"] == 64 * 192 for r in parity)


def test_triton_kernel_bytes_read_inductors_estimate() -> None:
    code = ("@triton_heuristics.pointwise(size_hints={'x': 1024}, inductor_meta={'grid_type': 'Grid1D', "
            "'kernel_name': 'triton_poi_fused_abs_0', 'mutated_arg_names': [], 'kernel_num_gb': 0.0125, "
            "'num_load': 1})\n@triton.jit\ndef triton_poi_fused_abs_0(in_ptr0, out_ptr0, xnumel, XBLOCK):\n")
    assert gpu_check.triton_kernel_bytes([code, "def cpp_fused_0(): pass"]) == {"triton_poi_fused_abs_0": 0.0125e9}


def test_a_failing_section_is_reported_and_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(gpu_check, "device_section", broken)
    code = gpu_check.main(["--dry-run", "--sections", "device", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and results["sections"]["device"]["status"] == "failed"
    assert "simulated device fault" in (tmp_path / "GPU.md").read_text()


def test_kernel_traffic_counts_each_kernels_arguments_against_the_floor(dry_run: tuple[int, dict, str]) -> None:
    """The dry run's kernel traffic (traced for CUDA on fake tensors): nvfp4's reduce-scatter on
    8 ranks, kernel by kernel, is what its arguments' sizes give, and lies just above the floor
    (the block statistics are written and read back once; the floor fuses them away)."""
    _, results, _ = dry_run
    rows = results["sections"]["kernel_traffic"]["result"]
    assert {(r["format"], r["op"]) for r in rows} == {(f, o) for f in gpu_check.TRAFFIC_FORMATS
                                                       for o in ("reduce_scatter", "all_reduce")}
    rs = next(r for r in rows if r["format"] == "nvfp4" and r["op"] == "reduce_scatter")
    n, world, block = 64 * 192, 8, 16
    stat, codes, payload = 4 / block, 1 / block, 0.5  # fp32 statistic, E4M3 code, 4-bit codes per element
    want = {("encode", "block_stat"): (4, stat), ("encode", "scale_codes"): (stat + 4 / n, codes),
            ("encode", "encode"): (4 + codes + 4 / n, payload),
            ("decode", "decode"): (payload + codes + 4 * world / n, 4 / world)}
    got = {(k["stage"], k["kernel"]): (k["reads_per_element"], k["writes_per_element"]) for k in rs["kernels"]}
    assert got.keys() == want.keys()
    for key, (reads, writes) in want.items():
        assert got[key] == (pytest.approx(reads), pytest.approx(writes)), key
    assert rs["kernel_bytes_per_element"] == pytest.approx(sum(sum(v) for v in want.values()))
    for r in rows:  # fp8's reduce-scatter is one kernel per side: at its floor, less the headers the glue writes
        low = 0.99 if r["format"].startswith("fp8") else 1.0
        assert low < r["kernel_over_floor"] < 1.2


def test_map_section_times_the_compiled_map_and_records_the_kernels_as_cuda_only(
        dry_run: tuple[int, dict, str]) -> None:
    _, results, _ = dry_run
    rows = {r["impl"]: r for r in results["sections"]["map"]["result"]}
    assert list(rows) == list(gpu_check.MAP_IMPLS)
    exact = rows["exact"]
    assert exact["status"] == "ok" and exact["time_us"] > 0 and exact["rel_error"] < 1e-5
    assert exact["vs_floor"] == pytest.approx(exact["time_us"] / exact["floor_us"])
    assert all(rows[i]["status"] == "not run: the explicit kernels need CUDA"
               for i in ("kernel-fp32", "kernel-tf32", "kernel-bf16"))


def test_the_map_kernel_impl_computes_the_map() -> None:
    """The map kernels' fp32 impl of the map section, run here in Triton's interpreter (the
    suite's CPU setting): the map's image, within fp32 rounding of `LowRank.apply_forward`."""
    from gift_compile.geometry import Transform
    from gift_compile.geometry.maps import LowRank

    t = Transform("lowrank", 96, 8, seed=0)
    t.refresh_from(gpu_check._synthetic_factor(96), 1e-3)
    g = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    ref = LowRank.apply_forward(g, t.tensors)
    out = gpu_check._map_forward("kernel-fp32", t.tensors)(g)
    assert float((out - ref).norm() / ref.norm()) < 1e-6 and not torch.equal(out, g)


def test_the_kernel_impl_is_timed_on_cuda_only_for_formats_with_kernels() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gpu_check.impls("euclid-nvfp4", cuda) == ("kernels", "inductor")
    assert gpu_check.impls("gift-nvfp4", cuda) == ("kernels", "inductor")
    assert gpu_check.impls("euclid-fp8", cuda) == ("kernels", "inductor")
    assert gpu_check.impls("euclid-nvfp4", cpu) == ("inductor",)


def test_render_prices_triton_kernels_against_the_measured_copy_bandwidth(dry_run: tuple[int, dict, str]) -> None:
    """The per-kernel table as a GPU run fills it (Triton kernels with bytes): the H200 run
    crashed here (`NameError: copy_bw`) after writing its JSON; the CPU dry run has no such rows."""
    _, results, _ = dry_run
    results = json.loads(json.dumps(results))
    row = next(r for r in results["sections"]["codec"]["result"] if r.get("status") == "ok")
    bw = results["sections"]["device"]["result"]["copy_bytes_per_s"]
    row["per_kernel"] = [{"kernel": "triton_poi_fused_0", "us": 10.0, "bytes": 1e6, "achieved_bytes_per_s": bw / 4}]
    # the same body with the explicit kernels, twice as fast: the kernels-over-Inductor table
    results["sections"]["codec"]["result"].append({**row, "impl": "kernels", "time_us": row["time_us"] / 2})
    md = gpu_check.render(results)
    line = md.split("| triton_poi_fused_0 |")[1].splitlines()[0]
    assert line.rstrip(" |").endswith("| 0.250")  # a quarter of the copy bandwidth
    ratio = md.split("Explicit kernels over Inductor-generated code")[1].split(f"| {row['path']} |")[1].splitlines()[0]
    assert ratio.rstrip(" |").endswith("| 0.500")


def test_torchtitan_section_is_skipped_with_its_reason_below_torch_2_13(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check.torch, "__version__", "2.11.0+cu130")
    assert gpu_check.torch_below("2.13") and not gpu_check.torch_below("2.11")
    code = gpu_check.main(["--dry-run", "--sections", "torchtitan", "--out", str(tmp_path)])
    status = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["torchtitan"]["status"]
    assert code == 0 and status == "skipped: torch 2.11.0+cu130 < 2.13 (torchtitan 0.3.0 needs it)"


def test_fold_section_computes_the_projection_both_ways_and_leaves_the_decision_to_a_gpu(
        dry_run: tuple[int, dict, str]) -> None:
    """The folded projection `dY^T (X U)` is the projection `G U` up to bf16 operand rounding (a
    wrong fold, say `X^T (dY U)`, would be off by the whole product), the byte counts follow the
    formulas, and the CPU's host-clock times decide nothing."""
    _, results, md = dry_run
    (row,) = results["sections"]["fold"]["result"]
    out, d_in, t, r = 64, 192, gpu_check.DRY_FOLD_TOKENS[0], 8
    assert (row["out"], row["d_in"], row["tokens"], row["rank"]) == (out, d_in, t, r)
    assert row["project_rel_error"] < 1e-6 and 1e-5 < row["fold_rel_error"] < 2e-2
    assert row["project_bytes"] == 4 * out * d_in + 4 * d_in * r + 4 * out * r
    assert row["fold_bytes"] == 2 * t * (d_in + out) + 2 * d_in * r + 4 * t * r + 4 * out * r
    assert row["fold_reads_fewer"] == (row["fold_bytes"] < row["project_bytes"]) is True  # 16 tokens: few
    assert min(row["dw_us"], row["project_us"], row["fold_us"]) > 0 and row["fold_wins"] is None
    assert "(not decided on the CPU)" in md


def test_gift_bodies_count_the_map_kernels_on_both_sides_and_no_matmul_outside_them() -> None:
    """GIFT's body (rank-8 low-rank map) on CUDA: the send side runs the map's projection, then
    the expansion fused into the block statistics and the encode (`kernels.fused_sender`: no
    kernel writes the mapped gradient), the receive side the projection and expansion after its
    decode, and no torch matmul is left outside the kernels (`measure` raises on one). Over the
    Euclidean send side that costs exactly the projection's read of G and the map's small
    operands (basis, projection, diagonals, coefficients) as each kernel reads or writes them."""
    from bench.fidelity import kernel_traffic

    rows, cols, r = 64, 192, 8
    euclid = kernel_traffic.measure("nvfp4", "reduce_scatter", rows, cols)
    gift = kernel_traffic.measure("nvfp4", "reduce_scatter", rows, cols, rank=r)
    stages = [(k["stage"], k["kernel"]) for k in gift["kernels"]]
    assert stages == [("encode", "lowrank_project"), ("encode", "lowrank_block_stat"), ("encode", "scale_codes"),
                      ("encode", "lowrank_encode"), ("decode", "decode"), ("decode", "lowrank_project"),
                      ("decode", "lowrank_expand")]
    project = next(k for k in gift["kernels"] if k["kernel"] == "lowrank_project")
    assert project["reads_per_element"] == pytest.approx(4 + 4 * r / rows)  # G and the [cols, r] basis
    assert project["writes_per_element"] == pytest.approx(4 * r / cols)  # P, [rows, r]
    assert all(k["writes_per_element"] < 1 for k in gift["kernels"] if k["stage"] == "encode")
    send = sum(k["reads_per_element"] + k["writes_per_element"] for k in gift["kernels"] if k["stage"] == "encode")
    euclid_send = sum(k["reads_per_element"] + k["writes_per_element"] for k in euclid["kernels"]
                      if k["stage"] == "encode")
    basis, p, diag, coef = 4 * cols * r, 4 * rows * r, 4 * cols, 4 * r
    # the basis read by all three map kernels, P written once and read twice, the diagonals and C twice
    assert send - euclid_send == pytest.approx(4 + (3 * basis + 3 * p + 2 * (2 * diag + coef)) / (rows * cols))
    assert gift["map"] == "lowrank" and gift["floor_bytes_per_element"] > euclid["floor_bytes_per_element"]


def test_kernel_traffic_block_judges_each_map_against_the_goal_from_the_results(tmp_path: Path) -> None:
    from bench.fidelity import kernel_traffic

    def body(kind: str, ratio: float) -> dict:
        return {"rows": 8, "cols": 8, "format": "nvfp4", "op": "reduce_scatter", "map": kind,
                "kernel_bytes_per_element": 10 * ratio, "floor_bytes_per_element": 10.0, "kernel_over_floor": ratio}

    path = tmp_path / "kernel_traffic.json"
    path.write_text(json.dumps({"command": "python -m bench.fidelity.kernel_traffic", "world": 8, "rank": 32,
                                "results": [body("identity", 1.05), body("lowrank", 1.2), body("lowrank", 1.25)]}))
    text = kernel_traffic.block(path=path)
    assert "identity bodies at most 1.05x their floor (within 1.3x); lowrank bodies at most 1.25x" in text
    path.write_text(json.dumps({"command": "python -m bench.fidelity.kernel_traffic", "world": 8, "rank": 32,
                                "results": [body("identity", 1.05), body("lowrank", 1.5)]}))
    assert "lowrank bodies at most 1.50x their floor (above 1.3x)" in kernel_traffic.block(path=path)


def test_kernel_traffic_carries_each_bodys_bytes_before_the_fused_sender(tmp_path: Path) -> None:
    """`carry_before`: a body's `before_fused_sender` is the replaced results file's own where it
    has one (kept across re-runs), else that file's kernel bytes; the block then shows both."""
    from bench.fidelity import kernel_traffic

    def body(kind: str, kernel: float, **extra: float) -> dict:
        return {"rows": 8, "cols": 8, "format": "nvfp4", "op": "reduce_scatter", "map": kind, "rank": 4, "world": 8,
                "kernel_bytes_per_element": kernel, "floor_bytes_per_element": 10.0,
                "kernel_over_floor": kernel / 10, **extra}

    path = tmp_path / "kernel_traffic.json"
    path.write_text(json.dumps({"results": [body("identity", 10.5), body("lowrank", 15.0)]}))
    new = [body("identity", 10.5), body("lowrank", 11.0)]
    kernel_traffic.carry_before(new, path)
    assert [r[kernel_traffic.BEFORE] for r in new] == [10.5, 15.0]
    path.write_text(json.dumps({"command": "python -m bench.fidelity.kernel_traffic", "world": 8, "rank": 4, "results": new}))
    again = [body("identity", 10.5), body("lowrank", 11.0)]
    kernel_traffic.carry_before(again, path)
    assert [r[kernel_traffic.BEFORE] for r in again] == [10.5, 15.0]
    assert "| lowrank | 11.000 | 10.000 | 1.100 | 15.000 | 1.500 |" in kernel_traffic.block(path=path)


def test_the_codec_sections_kernel_bytes_name_every_kernel_of_euclidean_and_gift_bodies() -> None:
    """The codec section prices each profiled kernel by its own bytes: every registered operator
    has its Triton function's name, and a GIFT body's bytes are its own (the low-rank map's and
    the fused sender's and receiver's kernels), not the Euclidean body's."""
    from gift_compile.kernels.traffic import KERNEL_OPS

    assert set(gpu_check._KERNEL_NAMES) == set(KERNEL_OPS)
    for fmt in ("fp8_e4m3", "nvfp4"):
        euclid, gift = gpu_check._kernel_bytes(fmt, 64, 256, 0), gpu_check._kernel_bytes(fmt, 64, 256, 8)
        assert not any(name.startswith("lowrank") for name in euclid), euclid
        assert {"lowrank_project_kernel", "lowrank_decode_expand_kernel" if fmt == "nvfp4"
                else "lowrank_fp8_decode_expand_kernel"} <= set(gift), gift
        assert sum(gift.values()) > sum(euclid.values())
