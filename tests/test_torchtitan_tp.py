"""Tensor parallelism x FSDP (2-D) with GIFT on torchtitan's two trainers, 4 gloo ranks (TP 2 x
FSDP 2).

Four runs, same seed, init and data: on the stock FSDP2 trainer GIFT at nvfp4 (a refresh after
step 2, so step 3 runs the measured selection with the TP-local maps), GIFT at fp32 and GIFT off
(~20-60 s each on a 2-core box); on graph_trainer (SimpleFSDP + TP) GIFT at nvfp4 (~1-2 min).
Each TP rank's weight block is its own GIFT matrix (colwise: [out/2, in], rowwise: [out, in/2]);
its reduce-scatter over the 2-rank FSDP group is GIFT's, and TP's activation collectives are
left as they are (counted in the traced step before and after the pass). nvfp4 must quantize
(round-trip error > 0), count at the collective exactly the bytes its plans account for, and
stay within the 2-rank tests' loss tolerance of the GIFT-off run; fp32 must have zero error and
reproduce GIFT-off's losses exactly (a sum of two fp32 gradients is the same in either order).
The graph_trainer run is held to the same tolerance against the stock trainer's GIFT-off run
(same model, data and seed; a GIFT-off graph_trainer run would be a fifth).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
TP = ["--parallelism.tensor-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("llama3_debug_gift_fsdp2", [*TP, *GIFT, "--gift.format=nvfp4"]),
        "fp32": ("llama3_debug_gift_fsdp2", [*TP, *GIFT, *EXACT_FP32]),
        "off": ("llama3_debug_nogift_fsdp2", TP),
        "graph": ("llama3_debug_gift_graph", [*TP, *GIFT, "--gift.format=nvfp4"]),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def _assert_tp_blocks(run: RunResult) -> None:
    """Each managed weight is this TP rank's block: colwise rows halved, rowwise columns halved."""
    blocks = re.search(r"GIFT TP: 20 managed weights are this TP rank's blocks, each its own GIFT matrix with "
                       r"statistics reduced over the 2-rank data-parallel group: (.*)", run.output)
    assert blocks, run.output[-3000:]
    for colwise in ("layers.0.attention.qkv_linear.wqkv.weight [384, 128] -> [192, 128]",
                    "layers.3.feed_forward.w1.weight [384, 128] -> [192, 128]"):
        assert colwise in blocks.group(1)
    for rowwise in ("layers.0.attention.wo.weight [128, 128] -> [128, 64]",
                    "layers.3.feed_forward.w2.weight [128, 384] -> [128, 192]"):
        assert rowwise in blocks.group(1)


def test_fsdp2_tp_quantizes_each_tp_block_at_nvfp4_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("nvfp4"), runs("off")
    assert REFUSAL not in gift.output and not gift.gift_warnings()
    _assert_tp_blocks(gift)
    # what fp32 would have handed over: the TP-local gradients (embedding and head [2048, 128]
    # each, per block wqkv/w1/w3 [192, 128] and wo [128, 64], w2 [128, 192], 9 norms of 128), not
    # the global ones (7.61 MB)
    tp_local = 2 * 2048 * 128 + 4 * (3 * 192 * 128 + 128 * 64 + 128 * 192) + 9 * 128
    for r in logged_steps(gift, STEPS):
        assert r["gift/baseline_bytes_per_step"] == 4 * tp_local, r
        # bytes handed to GIFT's reduce-scatters (counted at run time) == the TP-local plans' accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/collectives_per_step"] == 6, r  # one per FSDP parameter group
        assert r["gift/total_compression"] > 1.5, r
    # the round trip at nvfp4 on the TP-local blocks, measured at the refresh
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert gift.last("gift/managed_layers") == 20
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_fsdp2_tp_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    assert REFUSAL not in exact.output and not exact.gift_warnings()
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_graph_tp_rewrites_the_fsdp_reduce_scatters_and_leaves_tp_collectives(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("graph"), runs("off")
    assert REFUSAL not in gift.output and not gift.gift_warnings()
    _assert_tp_blocks(gift)
    # each block's bucketed reduce-scatter over the FSDP group became one GIFT all_to_all on the
    # TP-local gradients; TP's all-reduces / all-gathers / reduce-scatters in the same traced step,
    # forward and backward, are all still there (every trace: the first and the retrace after the
    # refresh's selection)
    found = re.findall(
        r"GIFT rewrite: 4 reduce-scatters \(4 buckets\) carrying 20 managed weights, 0 fallbacks; collective "
        r"launches per step (\d+) -> (\d+); bytes per step of the rewritten collectives (\d+) -> (\d+); TP "
        r"collectives left as they were: forward (\d+) -> (\d+), backward (\d+) -> (\d+)", gift.output)
    assert found, gift.output[-3000:]
    for before, after, base, wire, fwd_before, fwd_after, bwd_before, bwd_after in (map(int, f) for f in found):
        assert before == after and fwd_before == fwd_after > 0 and bwd_before == bwd_after > 0
        # the four block buckets' TP-local fp32 gradients (see the FSDP2 test), norms included
        assert base == 4 * (4 * (3 * 192 * 128 + 128 * 64 + 128 * 192) + 8 * 128) and wire < base / 5
    for r in logged_steps(gift, STEPS):
        # bytes handed to GIFT's collectives (counted at run time) == the pass's accounting
        assert (r["gift/wire_bytes_per_step"], r["gift/baseline_bytes_per_step"]) == (wire, base), r
        assert r["gift/collectives_per_step"] == 4, r
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    g, o = gift.losses(), off.losses()
    assert any(g[s] != o[s] for s in g if s > 1)
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)
