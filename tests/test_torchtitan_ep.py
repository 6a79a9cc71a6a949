"""Expert parallelism with GIFT on the stock FSDP2 trainer, 4 gloo ranks (FSDP 4, EP 2).

The ``gift_moe_debug`` DeepSeek-V3 MoE (one dense block, two MoE blocks of 4 grouped-GEMM routed
experts, top-2, and a shared expert; see `gift_compile.torchtitan_ext.models`) under torchtitan's
``apply_fsdp_to_decoder`` with EP 2: every MoE block is one FSDP module with two parameter groups,
the routed experts on the 2-rank ``efsdp`` mesh, the rest (attention, router and shared expert)
on the 4-rank ``fsdp`` mesh. GIFT's reduce-scatter goes on the fsdp group of each MoE block (and
on every dense module), GIFT's codec with no map on the experts' efsdp group
(`gift_compile.frameworks.fsdp2.EuclideanReduceScatter`: each grouped weight `[2 local experts,
64, 64]` one item `[128, 64]`), and the EP all-to-all on the token dispatcher is not touched
(GIFT only replaces FSDP2's reduce-scatter comms).

Four runs, same seed, init and data, with the default ``--gift.unrewritten error`` (nothing is
refused): GIFT at nvfp4 (a refresh after step 2, error feedback on, a checkpoint at the last
step), the same with the experts excluded, GIFT at fp32 and GIFT off (EP with TP, PP or HSDP:
tests/test_torchtitan_ep_layouts.py). nvfp4 must quantize the dense linears and the
experts (every parameter's fp32 gradient is GIFT's baseline; bytes counted at the collective ==
the plans' accounting; more than 80% of the experts' fp32 bytes saved against the same run with
them excluded; their round-trip error reported at every step; their error-feedback residuals,
each rank's own, in the checkpoint), name each expert module in one warning, and stay within the 2-rank tests' loss tolerance of GIFT off; fp32
must reproduce GIFT off's losses exactly (the experts' sum included). Measured 2026-12-05 on 2
cores shared with other jobs: the file 150 s at load 4-8, 170 s at load 12-17
(``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.kill_resume import checkpoint_tensors  # noqa: E402
from gift_compile.torchtitan_ext.models import MOE_FLAVORS  # noqa: E402
from gift_compile.torchtitan_ext.runs import RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_expert_residuals_checkpointed, assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
EP = ["--parallelism.data-parallel-shard-degree=4", "--parallelism.expert-parallel-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.error-feedback",
                                           "--checkpoint.enable", f"--checkpoint.interval={STEPS}"]),
        "fp32": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=fp32"]),
        # the routed experts excluded (GiftConfig.exclude): sent raw in their efsdp bucket
        "raw_experts": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4",
                                                 "--gift.exclude=*embed*,*output*,*lm_head*,*routed_experts*"]),
        "off": ("moe_debug_nogift_fsdp2", EP),
        # K-FAC's map named (the configs' AdamW resolves `auto` to second_moment, whose factor for a
        # 3-D weight is not wired): each local expert whitened as its own GIFT matrix
        "whitened": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.geometry=lowrank",
                                              "--checkpoint.enable", f"--checkpoint.interval={STEPS}"]),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def _assert_experts_on_gift(run: RunResult, fmt: str, route: str = r"reduce-scatters over mesh 'efsdp' \(2 ranks\)",
                           rows: int = 128, level: str = "WARNING") -> None:
    """Each routed-expert module is named in one `level` line saying its three grouped weights
    go on GIFT's codec with no map (`route`: how; `rows`: of the [rows, 64] items, 2 local experts
    x 64 rows at EP 2), and nothing else GIFT logs is a warning or a fallback, and no layout was
    refused."""
    assert REFUSAL not in run.output
    items = ", ".join(f"{w} as \\[{rows}, 64\\] at {fmt}" for w in ("w1_EFD", "w2_EDF", "w3_EFD"))
    lines = [line for line in run.output.splitlines() if "(GroupedExperts)" in line]
    found = {m.group(1) for line in lines
             if (m := re.search(rf"{level} .*GIFT: (\S+) \(GroupedExperts\) {route}.* with no map.*: {items}", line))}
    assert found == set(EXPERTS), "\n".join(lines) or run.output[-3000:]
    warnings = run.gift_warnings()
    assert all("(GroupedExperts)" in line for line in warnings), warnings
    assert bool(warnings) == (level == "WARNING"), warnings


def _elements(run: RunResult, ep: int = 2) -> tuple[int, int]:
    """The model's dense parameters (all but the routed experts') and the routed experts' on one
    EP rank (3 grouped weights of [E / ep, hidden, dim] per MoE block)."""
    total = int(re.search(r"gift_moe_debug size: ([\d,]+) total parameters", run.output).group(1).replace(",", ""))
    size = MOE_FLAVORS["gift_moe_debug"]
    experts = ((size["n_layers"] - size["n_dense_layers"]) * 3 * size["num_experts"] * size["moe_hidden_dim"]
               * size["dim"])
    return total - experts, experts // ep


def test_ep_quantizes_the_dense_layers_and_the_experts_at_nvfp4(runs: Callable[[str], RunResult]) -> None:
    gift, off, raw = runs("nvfp4"), runs("off"), runs("raw_experts")
    _assert_experts_on_gift(gift, "nvfp4")
    managed = re.search(r"GIFT: (\d+) weights managed \((.*)\)", gift.output)
    assert managed and int(managed.group(1)) == 18, gift.output[-3000:]
    names = managed.group(2).split(", ")
    # the MoE blocks' dense group: attention and shared expert linears are GIFT matrices
    for name in ("layers.1.attention.wkv_b.weight", "layers.2.attention.wo.weight",
                 "layers.1.moe.shared_experts.w1.weight", "layers.2.moe.shared_experts.w2.weight",
                 "layers.0.feed_forward.w3.weight"):
        assert name in names
    assert not [n for n in names if "routed_experts" in n]
    dense, experts = _elements(gift)
    for r in logged_steps(gift, STEPS):
        # GIFT's reduce-scatters carry every parameter's gradient (fp32 baseline): the dense ones and
        # this EP rank's experts
        assert r["gift/baseline_bytes_per_step"] == 4 * (dense + experts), r
        # bytes handed to GIFT's reduce-scatters (counted at run time) == the plans' accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        # one per FSDP parameter group: embeddings, the dense block, the two MoE blocks' fsdp and efsdp
        # groups, norm + head
        assert r["gift/collectives_per_step"] == 7, r
        assert "gift/full_precision_params" not in r, r
    # the experts at nvfp4 (0.5 B per element and an e4m3 scale per 16) send at least 80% fewer bytes
    # than the same run sends them raw (fp32), counted at the collectives, the dense layers equal
    assert "routed_experts.inner_experts (GroupedExperts) reduce-scatters over mesh 'efsdp' (2 ranks) on GIFT's " \
        "codec with no map" in raw.output and "nothing quantized; raw: w1_EFD, w2_EDF, w3_EFD" in raw.output
    for r, f in zip(logged_steps(gift, STEPS), logged_steps(raw, STEPS)):
        assert f["gift/wire_bytes_per_step"] - r["gift/wire_bytes_per_step"] > 0.8 * 4 * experts, (r, f)
        assert f["gift/baseline_bytes_per_step"] == r["gift/baseline_bytes_per_step"], (r, f)
        assert "gift/experts_err_euclidean_mean" not in f, f  # raw experts: no round trip to report
    # the experts' round-trip error at nvfp4 (reported at each logged step whose sent rows are not all
    # zero: at step 1 the rows rank 0 sends are all zero in this debug MoE)
    assert 0.03 < gift.last("gift/experts_err_euclidean_mean") < 0.3
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_experts_on_gift(exact, "fp32")
    dense, experts = _elements(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/baseline_bytes_per_step"] == 4 * (dense + experts), r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.last("gift/experts_err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_ep_keeps_each_ranks_expert_residuals_and_checkpoints_them(runs: Callable[[str], RunResult]) -> None:
    assert_expert_residuals_checkpointed(runs("nvfp4"), EXPERTS, STEPS)


def test_ep_whitens_each_expert_with_its_own_map(runs: Callable[[str], RunResult]) -> None:
    """Under the low-rank K-FAC map each local expert of each grouped weight is a GIFT layer of the
    experts' own state over efsdp (`runtime.experts`): its statistics from its routed tokens, its
    map refreshed at step 2, the grouped weight sent as one grouped item with the experts' maps.
    The checkpoint holds each expert's map (built: not the identity; each expert's own), the bytes
    counted equal the accounting and the Euclidean experts' run's, and the losses track GIFT off."""
    white, euclid, off = runs("whitened"), runs("nvfp4"), runs("off")
    for expert in EXPERTS:
        assert re.search(rf"GIFT: {re.escape(expert)} \(GroupedExperts\) reduce-scatters over mesh 'efsdp' \(2 ranks\)"
                         r" on GIFT's codec, each local expert a GIFT layer.*w1_EFD as \[128, 64\] at nvfp4, 2 experts "
                         r"each with its own lowrank map", white.output), white.output[-3000:]
    assert "not whitened" not in white.output
    for r, e in zip(logged_steps(white, STEPS), logged_steps(euclid, STEPS)):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"] == e["gift/wire_bytes_per_step"]
    folder = Path(white.command[white.command.index("--dump-folder") + 1]) / "checkpoint" / f"step-{STEPS}"
    flat = checkpoint_tensors(folder)
    for rank in range(4):
        for expert in EXPERTS:
            basis = [flat[f"gift.rank{rank}.sub0:{expert}.w1_EFD[{e}].transform.t1"] for e in range(2)]
            assert all(float(b.norm()) > 0 for b in basis), (rank, expert)  # refreshed: not the identity
            assert not torch.equal(basis[0], basis[1])  # each expert its own map
    # the experts' layers in telemetry: 2 blocks x 3 weights x 2 local experts, their errors measured
    # at their refresh on both paths
    assert white.last("gift/experts_layers") == 12 and 0 <= white.last("gift/experts_selected_layers") <= 12
    assert 0.03 < white.last("gift/experts_err_euclidean_mean") < 0.3
    assert 0.0 < white.last("gift/experts_err_transformed_mean") < 0.3
    assert_tracks_gift_off(white, off, TOLERANCE)
