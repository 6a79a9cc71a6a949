"""Expert parallelism with tensor or pipeline parallelism and FSDP, GIFT on the stock FSDP2
trainer, 4 gloo ranks.

The layout of tests/test_torchtitan_ep.py (see its docstring: GIFT on every FSDP module's fsdp
parameter group, each local routed expert a GIFT layer of the experts' own state over their efsdp
group) with

- FSDP 2 x TP 2, EP 2 (torchtitan's efsdp mesh is dp_shard x tp / ep = 2 ranks): each TP rank's
  attention and shared-expert block is its own GIFT matrix, as in tests/test_torchtitan_tp.py,
  and each local expert its own map (the configs' geometry, second_moment under AdamW).
  The TP-halved blocks of this tiny model have 2048-3072 elements, under the default
  ``min_numel`` 4096, so the runs set 1024 (21 managed blocks);
- PP 2 x FSDP 2, EP 2 (efsdp = 2 / 2 = 1 rank: each rank holds its stage's experts whole, their
  gradients cross no rank): one GIFT state per stage, as in tests/test_torchtitan_pp.py;
- HSDP (2 replicas x 2 shards), EP 2 (efsdp = 2 / 2 = 1 rank): GIFT's two hops on every MoE
  block's dense group (`gift_compile.frameworks.hsdp`, the replica hook set per parameter group),
  and on the experts' group the replica hop only (their one-rank efsdp group has no
  reduce-scatter), GIFT's codec with no map at the replica format. GIFT at nvfp4 on both hops,
  GIFT at fp32 (which must equal GIFT off exactly: a missing or double expert all-reduce would
  not) and GIFT off.

Seven runs, same seed, init and data per layout: GIFT at nvfp4 and GIFT off (and GIFT at fp32 under HSDP). Measured 2026-12-05
on 2 cores shared with other jobs: the TP pair 70 s at load 4, 130 s at load 16; the PP pair 166 s
at load 14; the file 295 s at load 14-16
(``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep_layouts.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from test_torchtitan_ep import (GIFT, STEPS, TOLERANCE, _assert_experts_on_gift, _assert_experts_whitened,  # noqa: E402
                                _elements)
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

EP_PP = ["--parallelism.data-parallel-shard-degree=2", "--parallelism.pipeline-parallel-degree=2",
         "--parallelism.expert-parallel-degree=2", "--validator.no-enable", f"--training.steps={STEPS}",
         "--metrics.log-freq=1"]
EP_HSDP = ["--parallelism.data-parallel-replicate-degree=2", "--parallelism.data-parallel-shard-degree=2",
           "--parallelism.expert-parallel-degree=2", "--validator.no-enable", f"--training.steps={STEPS}",
           "--metrics.log-freq=1"]
EP_TP = ["--parallelism.data-parallel-shard-degree=2", "--parallelism.tensor-parallel-degree=2",
         "--parallelism.expert-parallel-degree=2", "--validator.no-enable", f"--training.steps={STEPS}",
         "--metrics.log-freq=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "tp_nvfp4": ("moe_debug_gift_fsdp2", [*EP_TP, *GIFT, "--gift.format=nvfp4", "--gift.min-numel=1024"]),
        "tp_off": ("moe_debug_nogift_fsdp2", EP_TP),
        "pp_nvfp4": ("moe_debug_gift_fsdp2", [*EP_PP, "--gift.refresh-every=2", "--gift.no-fuse",
                                              "--gift.format=nvfp4"]),
        "pp_off": ("moe_debug_nogift_fsdp2", EP_PP),
        "hsdp_nvfp4": ("moe_debug_gift_fsdp2", [*EP_HSDP, *GIFT, "--gift.format=nvfp4", "--gift.replica-format=nvfp4"]),
        "hsdp_fp32": ("moe_debug_gift_fsdp2", [*EP_HSDP, *GIFT, *EXACT_FP32, "--gift.replica-format=fp32"]),
        "hsdp_off": ("moe_debug_nogift_fsdp2", EP_HSDP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def test_ep_with_tp_quantizes_each_tp_block_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("tp_nvfp4"), runs("tp_off")
    _assert_experts_whitened(gift, "nvfp4", "diagonal")  # the configs' geometry (auto -> second_moment)
    blocks = re.search(r"GIFT TP: 21 managed weights are this TP rank's blocks, each its own GIFT matrix with "
                       r"statistics reduced over the 2-rank data-parallel group: (.*)", gift.output)
    assert blocks, gift.output[-3000:]
    for block in ("layers.1.moe.shared_experts.w1.weight [64, 64] -> [32, 64]",
                  "layers.2.moe.shared_experts.w2.weight [64, 64] -> [64, 32]",
                  "layers.2.attention.wo.weight [64, 64] -> [64, 32]"):
        assert block in blocks.group(1)
    for r in logged_steps(gift, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.9 * r["gift/baseline_bytes_per_step"], r
        # the 5 fsdp parameter groups and the 2 MoE blocks' efsdp groups
        assert r["gift/collectives_per_step"] == 7, r
        assert "gift/full_precision_params" not in r, r
    assert 0.03 < gift.last("gift/experts_err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_with_pp_runs_gift_per_stage_and_experts_cross_no_rank(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("pp_nvfp4"), runs("pp_off")
    assert REFUSAL not in gift.output
    assert not gift.gift_warnings()
    for layer in (1, 2):
        assert (f"GIFT: layers.{layer}.moe.routed_experts.inner_experts (GroupedExperts) is sharded over mesh "
                "'efsdp' (one rank): its gradient crosses no rank") in gift.output
    # stage 0: embeddings, the dense block, MoE block 1; stage 1: MoE block 2, norm + head
    for stage, (managed, collectives) in {0: (12, 3), 1: (6, 2)}.items():
        records = [r for r in gift.stages[stage] if "gift/managed_layers" in r]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), stage
        for r in records:
            assert r["gift/managed_layers"] == managed and r["gift/collectives_per_step"] == collectives, r
            assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
            # fewer than fp32 (stage 1 only 1.08x: its unmanaged 4096 x 64 head is most of its bytes)
            assert r["gift/wire_bytes_per_step"] < r["gift/baseline_bytes_per_step"], r
            assert "gift/full_precision_params" not in r, r
            assert "gift/experts_err_euclidean_mean" not in r, r  # one-rank efsdp: the experts send nothing
    assert sorted(gift.losses()) == list(range(1, STEPS + 1))
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_with_hsdp_runs_both_hops_on_the_dense_groups_and_the_replica_hop_on_the_experts(
        runs: Callable[[str], RunResult]) -> None:
    gift, exact, off = runs("hsdp_nvfp4"), runs("hsdp_fp32"), runs("hsdp_off")
    _assert_experts_on_gift(gift, "nvfp4", r"is sharded over mesh 'efsdp' \(one rank\)", level="INFO")
    # at fp32 (every format's opt-out) the replica hop carries the experts raw: they are outside
    # GIFT's layers, where fp32 means raw bytes
    assert REFUSAL not in exact.output
    raw = {m.group(1) for line in exact.output.splitlines()
           if (m := re.search(r"INFO .*GIFT: (\S+) \(GroupedExperts\) is sharded over mesh 'efsdp' \(one rank\).*"
                              r"nothing quantized; raw: w1_EFD, w2_EDF, w3_EFD", line))}
    assert raw == {f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)}, exact.output[-3000:]
    quantized, raw = logged_steps(gift, STEPS), logged_steps(exact, STEPS)
    _, experts = _elements(gift)
    for r, f in zip(quantized, raw):
        for rec in (r, f):
            # each hop's bytes counted at the collective == its plans' accounting
            assert rec["gift/wire_bytes_per_step"] == rec["gift/shard_accounted_bytes_per_backward"], rec
            assert rec["gift/replica_wire_bytes_per_step"] == rec["gift/replica_accounted_bytes_per_backward"], rec
            # the shard hop: one GIFT collective per fsdp parameter group (the experts' one-rank efsdp group
            # has none); the replica hop: those and the experts' groups, whose reduced shard is this EP rank's
            # whole experts
            assert rec["gift/collectives_per_step"] == 5 and rec["gift/replica_collectives_per_step"] == 7, rec
            assert rec["gift/replica_baseline_bytes_per_step"] == rec["gift/baseline_bytes_per_step"] / 2 + 4 * experts
            assert "gift/full_precision_params" not in rec, rec
        # nvfp4 quantized both hops: fewer bytes than the same plans at fp32
        assert r["gift/wire_bytes_per_step"] < 0.9 * f["gift/wire_bytes_per_step"], (r, f)
        assert r["gift/replica_wire_bytes_per_step"] < 0.9 * f["gift/replica_wire_bytes_per_step"], (r, f)
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert exact.last("gift/err_euclidean_mean") == 0.0
    # the experts' only hop quantized them (their round-trip error at nvfp4); at fp32 it sends them raw, with no
    # round trip to report
    assert 0.03 < gift.last("gift/experts_err_euclidean_mean") < 0.3
    assert not [r for r in exact.records if "gift/experts_err_euclidean_mean" in r]
    # fp32 on both hops reproduces native HSDP's losses exactly (experts all-reduced once, over the replicas)
    assert exact.losses() == off.losses()
    assert_tracks_gift_off(gift, off, TOLERANCE)
