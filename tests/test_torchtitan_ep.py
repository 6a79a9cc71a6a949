"""Expert parallelism with GIFT on the stock FSDP2 trainer, 4 gloo ranks (FSDP 4, EP 2).

The ``gift_moe_debug`` DeepSeek-V3 MoE (one dense block, two MoE blocks of 4 grouped-GEMM routed
experts, top-2, and a shared expert; see `gift_compile.torchtitan_ext.cpu.models`) under torchtitan's
``apply_fsdp_to_decoder`` with EP 2: every MoE block is one FSDP module with two parameter groups,
the routed experts on the 2-rank ``efsdp`` mesh, the rest (attention, router and shared expert)
on the 4-rank ``fsdp`` mesh. GIFT's reduce-scatter goes on the fsdp group of each MoE block (and
on every dense module) and on the experts' efsdp group, where each local expert of each grouped
weight `[2 local experts, 64, 64]` is a GIFT layer of the experts' own state
(`gift_compile.runtime.experts`, sent as one grouped item `[128, 64]` with one map per expert);
with no map (``--gift.geometry none``) the experts go as Euclidean items
(`gift_compile.frameworks.fsdp2.EuclideanReduceScatter`). The EP all-to-all on the token
dispatcher is not touched (GIFT only replaces FSDP2's reduce-scatter comms).

Six runs from one seed checkpoint written on one rank (same init and data), with the default ``--gift.unrewritten error`` (nothing is
refused): GIFT at nvfp4 with the configs' geometry (``auto``: second_moment under AdamW; a refresh
after step 2, error feedback on, a checkpoint at the last step), the same with no map, the same
with K-FAC's low-rank map, GIFT at nvfp4 with the experts excluded, GIFT at fp32 and GIFT off (EP
with TP, PP or HSDP: tests/test_torchtitan_ep_layouts.py). nvfp4 must quantize the dense linears
and the experts (every parameter's fp32 gradient is GIFT's baseline; bytes counted at the
collective == the plans' accounting == plain low-bit's; more than 80% of the experts' fp32 bytes
saved against the run with them excluded; each expert's map built from its own statistics or its
own rows of AdamW's second moment; their error-feedback residuals, each rank's own, in the
checkpoint) and stay within the 2-rank tests' loss tolerance of GIFT off; fp32 must reproduce
GIFT off's losses exactly (the experts' sum included).
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
from gift_compile.torchtitan_ext.cpu.kill_resume import checkpoint_tensors  # noqa: E402
from gift_compile.torchtitan_ext.cpu.models import MOE_FLAVORS  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, seed_checkpoint, shared_runs  # noqa: E402
from torchtitan_checks import assert_expert_residuals_checkpointed, assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
EP = ["--parallelism.data-parallel-shard-degree=4", "--parallelism.expert-parallel-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    # every run from one rank's seed checkpoint: EP's own CPU init gives each rank pairs of
    # identical experts and router rows (`seed_checkpoint`), so two local experts would see the
    # same tokens and be no test of "each expert its own map"
    start = seed_checkpoint(tmp_path_factory.mktemp("seed"), "moe_debug_nogift_fsdp2")
    table = {
        # the configs' geometry: `auto`, which AdamW resolves to second_moment (each local expert its own map)
        "nvfp4": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.error-feedback",
                                           "--checkpoint.enable", f"--checkpoint.interval={STEPS}"]),
        # plain low-bit (no map): the experts go as Euclidean items, their residuals the state's own
        "plain": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.geometry=none",
                                           "--gift.error-feedback", "--checkpoint.enable",
                                           f"--checkpoint.interval={STEPS}"]),
        "fp32": ("moe_debug_gift_fsdp2", [*EP, *GIFT, *EXACT_FP32]),
        # the routed experts excluded (GiftConfig.exclude) and sent raw (`excluded_format=fp32`, the
        # opt-out: the default would send them at bf16) in their efsdp bucket
        "raw_experts": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.excluded-format=fp32",
                                                 "--gift.exclude=*embed*,*output*,*lm_head*,*routed_experts*"]),
        "off": ("moe_debug_nogift_fsdp2", EP),
        # K-FAC's low-rank map named: each local expert's map from the tokens routed to it
        "whitened": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.geometry=lowrank",
                                              "--checkpoint.enable", f"--checkpoint.interval={STEPS}"]),
    }
    return shared_runs({name: (config, [*start, *overrides]) for name, (config, overrides) in table.items()},
                       lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


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


def _assert_experts_whitened(run: RunResult, fmt: str, kind: str) -> None:
    """Each routed-expert module is named in one line saying each local expert of its three
    grouped weights is a GIFT layer of the experts' own state with its own `kind` map, at `fmt`,
    and GIFT logged no warning and refused no layout."""
    assert REFUSAL not in run.output and "not whitened" not in run.output
    for expert in EXPERTS:
        assert re.search(rf"GIFT: {re.escape(expert)} \(GroupedExperts\) reduce-scatters over mesh 'efsdp' \(2 ranks\)"
                         rf" on GIFT's codec, each local expert a GIFT layer.*w1_EFD as \[128, 64\] at {fmt}, 2 experts "
                         rf"each with its own {kind} map", run.output), run.output[-3000:]
    assert not run.gift_warnings(), run.gift_warnings()


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
    _assert_experts_whitened(gift, "nvfp4", "diagonal")
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
    # the experts' round-trip error at nvfp4, measured at their refresh (step 2)
    assert 0.03 < gift.last("gift/experts_err_euclidean_mean") < 0.3
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_experts_whitened(exact, "fp32", "diagonal")
    dense, experts = _elements(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/baseline_bytes_per_step"] == 4 * (dense + experts), r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.last("gift/experts_err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_ep_keeps_each_ranks_expert_residuals_and_checkpoints_them(runs: Callable[[str], RunResult]) -> None:
    assert_expert_residuals_checkpointed(runs("nvfp4"), EXPERTS, STEPS, local_experts=2)  # the experts' layers
    assert_expert_residuals_checkpointed(runs("plain"), EXPERTS, STEPS)  # outside the layers


def test_ep_default_geometry_scales_each_expert_by_its_own_second_moment(runs: Callable[[str], RunResult]) -> None:
    """What a user gets with the configs' `auto` geometry under AdamW: each local expert's column
    scales come from its own column sums of the 3-D weight's `exp_avg_sq` (the factor its
    refresh kept, summed over the efsdp ranks: not the identity, the scales its function; that
    they are the expert's own rows is tests/test_expert_layers.py's), the selection judges the
    experts (some on their map), and the experts' bytes equal plain low-bit's (a map changes
    what is sent, not how much). (In this debug MoE on the CPU the two local experts of an EP
    rank hold equal weights and optimizer states, as their checkpoint shows, so their maps may
    be equal too.)"""
    gift, plain = runs("nvfp4"), runs("plain")
    _assert_experts_on_gift(plain, "nvfp4", level="INFO")  # under --gift.geometry none: no warning
    folder = Path(gift.command[gift.command.index("--dump-folder") + 1]) / "checkpoint" / f"step-{STEPS}"
    flat = checkpoint_tensors(folder)
    for rank in range(4):
        for expert in EXPERTS:
            for w in ("w1_EFD", "w2_EDF", "w3_EFD"):
                for e in range(2):
                    key = f"gift.rank{rank}.sub0:{expert}.{w}[{e}]"
                    scales, c = flat[f"{key}.transform.t0"], flat[f"{key}.grad_factor"].double()
                    assert not torch.allclose(scales, torch.ones_like(scales)), key
                    c = c.clamp(min=float(c[c > 0].min()))
                    torch.testing.assert_close(scales, (c / c.mean()).rsqrt().float(), rtol=1e-5, atol=0)
    assert gift.last("gift/experts_layers") == 12 and gift.last("gift/experts_selected_layers") > 0
    for r, p in zip(logged_steps(gift, STEPS), logged_steps(plain, STEPS)):
        assert r["gift/wire_bytes_per_step"] == p["gift/wire_bytes_per_step"] == p["gift/accounted_bytes_per_backward"]


def test_ep_whitens_each_expert_with_its_own_map(runs: Callable[[str], RunResult]) -> None:
    """Under the low-rank K-FAC map each local expert of each grouped weight is a GIFT layer of the
    experts' own state over efsdp (`runtime.experts`): its statistics from its routed tokens, its
    map refreshed at step 2, the grouped weight sent as one grouped item with the experts' maps.
    The checkpoint holds each expert's map (built: not the identity; each expert's own), the bytes
    counted equal the accounting and the Euclidean experts' run's, and the losses track GIFT off."""
    white, euclid, off = runs("whitened"), runs("plain"), runs("off")
    _assert_experts_whitened(white, "nvfp4", "lowrank")
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
