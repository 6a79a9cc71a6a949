"""torchtitan integration on 2 gloo ranks: both trainers train, with and without GIFT.

Each run is a real ``torchrun`` job of one of our config functions on the ``gift_debug``
Llama (seq 128, 4 sequences per rank, 6 steps, GIFT refresh every 3 steps so steps 4-6
use the refreshed geometry). On a 2-core box a run takes 25-40 s; runs are shared between
the tests of this module, so no test pays for more than two runs (< 3 minutes), except the
resume tests: three runs on 2 ranks (uninterrupted, killed, relaunched), and three 4-rank runs
per layout for HSDP, PP 2 x FSDP 2 and TP 2 x FSDP 2 (~2 minutes per layout). The GIFT-off
baseline of both trainers' GIFT runs is the FSDP2 trainer's; `make test` runs seven of these
launches (tests/tiers.py names the rest, which only `make test-full` runs).

Tolerance of GIFT against GIFT-off: FP8 E4M3 per-row quantization of the managed
gradients perturbs each step's update by ~2% relative (docs/design.md, formats table); over 6
AdamW steps the loss moves by ~1e-4, so we require |loss_gift - loss_off| < 5e-3 per step
(an order of magnitude below the 0.2-0.5 loss drop the runs show) and that GIFT really
ran (rewrite, wire bytes, refresh).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

import torch  # noqa: E402

from gift_compile.torchtitan_ext.cpu.demo import (  # noqa: E402
    closer_to_fp32,
    last_measured_refresh,
    resolved_choices,
    selected_errors,
)
from gift_compile.torchtitan_ext.cpu.kill_resume import KillResume, checkpoint_tensors, kill_and_resume  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import RunResult, run_config  # noqa: E402

STEPS = 6
COMMON = ["--validator.no-enable", f"--training.steps={STEPS}", "--gift.refresh-every=3"]
# K-FAC's map, named: these runs check that the transformed path is selected, tracks GIFT-off and
# resumes; the default under the configs' AdamW (`auto` -> second_moment, measured
# selection) has its own test below and may keep no layer in six steps.
LOWRANK = "--gift.geometry=lowrank"
GIFT_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., RunResult]:
    """``run(config, *extra)``: a successful run, computed once per module."""
    cache: dict[tuple[str, ...], RunResult] = {}

    def get(config: str, *extra: str) -> RunResult:
        key = (config, *extra)
        if key not in cache:
            folder = tmp_path_factory.mktemp(config)
            cache[key] = run_config(config, [*COMMON, *extra], dump_folder=str(folder)).check()
        return cache[key]

    return get


def _assert_trains(result: RunResult) -> dict[int, float]:
    losses = result.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 0.2, losses
    return losses


def _assert_close(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    for step in a:
        assert abs(a[step] - b[step]) < tol, (step, a, b)


def test_graph_trainer_and_fsdp2_train_identically_without_gift(run: Callable[..., RunResult]) -> None:
    """Same seed/init/data: SimpleFSDP (traced) and FSDP2 (eager) give the same losses."""
    graph = _assert_trains(run("llama3_debug_nogift_graph"))
    fsdp2 = _assert_trains(run("llama3_debug_nogift_fsdp2"))
    _assert_close(graph, fsdp2, 1e-4)


def _assert_gift_ran(result: RunResult) -> None:
    assert result.last("gift/managed_layers") == 20  # 4 blocks x (wqkv, wo, w1, w2, w3)
    assert result.last("gift/selected_layers") >= 1  # the refresh enabled the transformed path
    assert result.last("gift/refresh_step") == 6  # refreshes after the optimizer steps 3 and 6
    assert result.last("gift/refresh_s") > 0
    assert result.last("gift/err_transformed_mean") < result.last("gift/err_euclidean_mean")
    # bytes counted at run time by the collectives, every step the same
    wire = [r["gift/wire_bytes_per_step"] for r in result.records if "gift/wire_bytes_per_step" in r]
    assert len(wire) == STEPS and len(set(wire)) == 1, wire
    # quantized: fewer bytes than fp32 would have sent (the exact figure is checked against the
    # shape-based accounting of the path's plans by each caller)
    assert wire[0] < result.last("gift/baseline_bytes_per_step"), wire


def test_gift_graph_trainer_tracks_gift_off(run: Callable[..., RunResult]) -> None:
    """graph_trainer: the pass rewrote the traced reduce-scatters (fused by regional
    Inductor, the default); losses track GIFT-off."""
    gift = run("llama3_debug_gift_graph", LOWRANK)
    _assert_gift_ran(gift)
    # the GPU pass list ran: FSDP bucketing merged each block's reduce-scatters, and each
    # block's bucket became ONE GIFT all_to_all (launch count unchanged)
    applied = gift.output[gift.output.index("graph passes:"):]
    for name in ("joint_transformer_block_bucketing_reordering_pass", "selective_activation_remat_pass",
                 "gift_rewrite_pass", "regional_inductor_pass"):
        assert f". {name}" in applied, name
    m = re.search(r"GIFT rewrite: (\d+) reduce-scatters \((\d+) buckets\) carrying (\d+) managed weights, 0 fallbacks; "
                  r"collective launches per step (\d+) -> (\d+); bytes per step of the rewritten collectives "
                  r"(\d+) -> (\d+)", gift.output)
    assert m, gift.output[-3000:]
    n, buckets, layers, before, after, base_acct, wire_acct = map(int, m.groups())
    assert (n, buckets, layers) == (4, 4, 20) and before == after
    # what the collectives counted at run time equals the shape-based accounting of the pass
    assert gift.last("gift/wire_bytes_per_step") == wire_acct == gift.last("gift/accounted_bytes_per_backward")
    assert gift.last("gift/baseline_bytes_per_step") == base_acct
    assert gift.last("gift/collectives_per_step") == 4
    # held to the FSDP2 trainer's GIFT-off run: without GIFT the two trainers train alike (within 1e-4,
    # test_graph_trainer_and_fsdp2_train_identically_without_gift), so one baseline serves both
    _assert_close(_assert_trains(gift), run("llama3_debug_nogift_fsdp2").losses(), GIFT_TOLERANCE)


def test_gift_fsdp2_tracks_gift_off_and_matches_graph_path(run: Callable[..., RunResult]) -> None:
    """FSDP2 custom reduce-scatter (calling the torch.compile'd core: fuse is on by default):
    tracks GIFT-off and computes what the graph path does."""
    gift = run("llama3_debug_gift_fsdp2", LOWRANK)
    _assert_gift_ran(gift)
    # one GIFT collective per FSDP module, each carrying every gradient of the module
    assert gift.last("gift/collectives_per_step") == 6
    # every byte counted at run time is the shape-based accounting of the modules' plans (a codec
    # that sent fp32, or another format, would count other bytes)
    assert gift.last("gift/wire_bytes_per_step") == gift.last("gift/accounted_bytes_per_backward")
    assert gift.last("gift/comm_s_per_step") > 0
    # the hooks' codec compiled once per item plan and stage, never again: the debug Llama's
    # managed shapes on the transformed and the Euclidean path, full-precision items by size
    assert 0 < gift.last("gift/codec_compilations") == gift.last("gift/codec_bodies") <= 2 * 16
    assert gift.last("gift/codec_recompiles") == 0 and gift.last("gift/codec_bodies_evicted") == 0
    losses = _assert_trains(gift)
    _assert_close(losses, run("llama3_debug_nogift_fsdp2").losses(), GIFT_TOLERANCE)
    # Same quantized collective, same transforms: eager FSDP2 and the traced graph agree.
    _assert_close(losses, run("llama3_debug_gift_graph", LOWRANK).losses(), 1e-4)


def _second_moment_map(exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """`SecondMoment`'s column scales, recomputed here from a full `exp_avg_sq` (the reference
    the run's map must equal: `s = (c / mean c)^(-1/2)`, `c` its column sums clamped at the
    smallest positive one)."""
    c = exp_avg_sq.double().sum(dim=0)
    c = c.clamp(min=float(c[c > 0].min()))
    return (c / c.mean()).rsqrt().float()


def test_auto_by_optimizer_builds_second_moment_from_adamw_state(run: Callable[..., RunResult]) -> None:
    """``--gift.geometry auto_by_optimizer`` (the alias of ``auto``, as existing TOMLs spell it)
    under the configs' AdamW: the geometry resolved is
    `second_moment`, and each refresh rebuilds every rank's map from the optimizer's sharded
    `exp_avg_sq` (the DCP checkpoints after the refreshes at steps 3 and 6 hold both, per rank).
    NVFP4, where the study measured the map's gain; at FP8 the selection keeps it off."""
    args = ["--gift.format=nvfp4", "--gift.geometry=auto_by_optimizer", "--gift.no-fuse",
            "--checkpoint.enable", "--checkpoint.interval=3"]
    gift = run("llama3_debug_gift_fsdp2", *args)
    # resolved by `gift_compile.api.resolve_auto`, as `apply` resolves it; logged by each rank
    assert gift.output.count("GIFT: geometry='auto' -> 'second_moment'") == 2
    # what `make demo` prints from the same log
    assert resolved_choices(gift.output) == {"geometry": "second_moment", "select_metric": "whitened"}
    _assert_gift_ran(gift)  # quantized at the collective (fewer bytes than fp32), error > 0, selected
    assert gift.last("gift/err_euclidean_mean") > 0
    assert gift.last("gift/wire_bytes_per_step") == gift.last("gift/accounted_bytes_per_backward")
    _assert_close(_assert_trains(gift), run("llama3_debug_nogift_fsdp2").losses(), GIFT_TOLERANCE)
    # what `make demo` reports of GIFT vs plain low-bit from the same records: over the layers the
    # selection kept at nvfp4, GIFT's map has the lower round-trip error
    refresh = last_measured_refresh(gift)
    assert refresh is not None
    n_selected, n_measured, euclidean, transformed = selected_errors(refresh)
    assert n_measured >= n_selected >= 1, refresh
    assert 0 < transformed < euclidean, (transformed, euclidean)

    folder = Path(gift.command[gift.command.index("--dump-folder") + 1]) / "checkpoint"
    first, second = (checkpoint_tensors(folder / f"step-{s}") for s in (3, STEPS))
    layers = sorted(k.removeprefix("gift.rank0.").removesuffix(".transform.t0") for k in first
                    if k.startswith("gift.rank0.") and k.endswith(".transform.t0"))
    assert len(layers) == 20
    changed = 0
    for name in layers:
        # step 3 decided every layer from its map; step 6 rebuilt the selected layers' maps
        for ckpt, rebuilt in ((first, True), (second, bool(second[f"gift.rank0.{name}.selected"]))):
            maps = [ckpt[f"gift.rank{r}.{name}.transform.t0"] for r in (0, 1)]
            assert torch.equal(maps[0], maps[1]), name  # every rank applies the same map
            source = ckpt if rebuilt else first
            expected = _second_moment_map(source[f"optimizer.state.{name}.exp_avg_sq"])
            torch.testing.assert_close(maps[0], expected, rtol=1e-5, atol=0)
            assert float(expected.max() / expected.min()) > 1.5, name  # not the identity
        if bool(second[f"gift.rank0.{name}.selected"]):
            changed += not torch.equal(first[f"gift.rank0.{name}.transform.t0"],
                                       second[f"gift.rank0.{name}.transform.t0"])
    assert changed == gift.last("gift/selected_layers") >= 1  # exp_avg_sq moved between the refreshes


def test_demo_names_the_arm_closer_to_fp32() -> None:
    """The demo's verdict follows the measured distances, both printed; a tie claims no winner."""
    assert closer_to_fp32(4.10, 4.30, 4.05).startswith("GIFT is closer to fp32 than plain low-bit")
    assert closer_to_fp32(4.30, 4.10, 4.05).startswith("plain low-bit is closer to fp32 than GIFT")
    assert "|GIFT - fp32| = 0.25000, |plain - fp32| = 0.05000" in closer_to_fp32(4.30, 4.10, 4.05)
    assert closer_to_fp32(4.25, 4.0, 4.125).startswith("GIFT and plain low-bit are equally close")


@pytest.mark.parametrize("config", ["llama3_debug_gift_fsdp2", "llama3_debug_gift_graph"])
def test_resume_restores_gift_state(config: str, tmp_path: Path) -> None:
    """A rank killed mid-run; the relaunched job resumes from the step-3 DCP checkpoint (just after a
    refresh) and ends bit-identical to the uninterrupted run.

    Error feedback is on so the per-rank residuals must round-trip too; the relaunched run's
    telemetry shows the restored selection (a fresh GIFT state would select nothing).
    """
    # No Inductor fusion here: it only adds compile time (test_gift_graph_trainer_tracks_gift_off covers it).
    args = [*COMMON, LOWRANK, "--gift.error-feedback", "--gift.no-fuse", "--checkpoint.enable",
            "--checkpoint.interval=3"]
    full = run_config(config, args, dump_folder=str(tmp_path / "full")).check()
    # A rank killed (kill -9) after step 4: the job fails; relaunched on the same folder it
    # resumes from the step-3 checkpoint and ends with the uninterrupted run's parameters,
    # optimizer and GIFT state, bit for bit. (torchrun's in-place restart, --max-restarts=1,
    # cannot be used on gloo here: the restarted workers read the killed attempt's gloo
    # addresses from the agent's store and fail in connectFullMesh; see docs/torchtitan/configuration.md.)
    found = _kill_relaunch_and_compare(config, args, tmp_path / "killed", full, tmp_path / "full")
    first = next(r for r in found.relaunched.records if r.get("step") == 4)
    expected = next(r for r in full.records if r.get("step") == 4)
    assert first["gift/selected_layers"] == expected["gift/selected_layers"] >= 1


# The 4-rank layouts whose kill-and-resume is checked like the 2-rank FSDP one above.
LAYOUTS = {
    "hsdp": ["--parallelism.data-parallel-replicate-degree=2", "--parallelism.data-parallel-shard-degree=2"],
    "pp": ["--parallelism.pipeline-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2"],
    "tp": ["--parallelism.tensor-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kill_and_resume_under_hsdp_pp_and_tp(layout: str, tmp_path: Path) -> None:
    """HSDP 2 replicas x 2 shards (both hops' GIFT state on every rank, the shard-only mesh),
    PP 2 x FSDP 2 (each stage's GIFT state saved by each of its ranks) and TP 2 x FSDP 2 (each
    TP rank's blocks): a rank killed after step 4 of 6, the job relaunched on the same folder
    resumes from the step-3 checkpoint (just after a refresh, error feedback on) and logs the
    uninterrupted run's losses for steps 4-6 and ends with its parameters, optimizer and GIFT
    state, bit for bit: same ranks, same data, same reduction order, so nothing may differ."""
    config = "llama3_debug_gift_fsdp2"
    args = [*COMMON, *LAYOUTS[layout], LOWRANK, "--gift.error-feedback", "--gift.no-fuse", "--checkpoint.enable",
            "--checkpoint.interval=3"]
    full = run_config(config, args, dump_folder=str(tmp_path / "full"), nproc=4).check()
    assert any(r.get("gift/selected_layers", 0) >= 1 for r in full.records if r.get("step", 0) > 3)
    if layout == "hsdp":  # GIFT's replica hop ran (not FSDP2's native HSDP all-reduce)
        assert all(r["gift/replica_wire_bytes_per_step"] > 0 for r in full.records if "loss" in r)
    _kill_relaunch_and_compare(config, args, tmp_path / "killed", full, tmp_path / "full", nproc=4)


def _kill_relaunch_and_compare(config: str, args: list[str], folder: Path, full: RunResult, full_folder: Path, *,
                               nproc: int = 2) -> KillResume:
    """Kill rank 1 after step 4, relaunch on `folder`, and require the uninterrupted run's
    losses after the resume (within 1e-6: the logged loss is a float32 reduction printed
    and parsed, and the runs are bitwise identical) and its final checkpoint, bit for bit."""
    found = kill_and_resume(config, args, folder, full, full_folder, steps=STEPS, after_step=4, nproc=nproc)
    assert found.killed_returncode != 0 and found.killed_after_step >= 4, found.relaunched.output[-3000:]
    assert not found.final_checkpoint_before_relaunch
    assert found.loaded_checkpoint and found.replayed_steps and min(found.replayed_steps) >= 4, found.replayed_steps
    assert max(found.loss_diff.values()) <= 1e-6, found.loss_diff
    assert found.has_optimizer_and_gift_state and found.key_sets_equal
    assert not found.differing, found.differing
    assert found.bit_identical
    return found
