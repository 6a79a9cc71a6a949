"""The 8-rank layouts with GIFT on torchtitan's FSDP2 trainer, 8 gloo ranks: HSDP x TP
(dp_replicate 2 x dp_shard 2 x tp 2) and PP x TP x FSDP (pp 2 x tp 2 x dp_shard 2).

Six runs of the debug Llama, same seed, init and data, 3 steps with a refresh after step 2
(step 3 runs the measured selection), ~50-70 s each on a 2-core box (313 s for the module): per layout GIFT at nvfp4,
GIFT at fp32 and GIFT off. What the 4-rank tests (test_torchtitan_tp.py, test_torchtitan_hsdp.py,
test_torchtitan_pp.py) check, at 8 ranks: each TP rank's block is its own GIFT matrix, under
HSDP its reduced shard crosses the replica hop (half the TP-local shard hop's fp32 bytes), under
PP each stage manages its own layers; every hop hands its collective exactly the bytes its plans
account for; nvfp4 quantizes (round-trip error > 0, fewer bytes than fp32, losses moved) and
stays within the 2-rank tests' loss tolerance of GIFT off; fp32 reproduces GIFT off's losses
exactly. graph_trainer's HSDP x TP run (~4 min: it traces and compiles the step) and every
row's numbers are in `bench.cluster.layouts` (bench/results/cluster/layouts.json).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off  # noqa: E402

STEPS = 3
COMMON = ["--parallelism.tensor-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2",
          "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
HSDP_TP = [*COMMON, "--parallelism.data-parallel-replicate-degree=2"]
PP_TP = [*COMMON, "--parallelism.pipeline-parallel-degree=2"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
NVFP4 = [*GIFT, "--gift.format=nvfp4", "--gift.replica-format=nvfp4"]
FP32 = [*GIFT, *EXACT_FP32, "--gift.replica-format=fp32"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
# One TP rank's fp32 gradient elements of a transformer block: wqkv, w1, w3 [192, 128] (colwise),
# wo [128, 64] and w2 [128, 192] (rowwise), two norms of 128 (replicated over TP)
BLOCK = 3 * 192 * 128 + 128 * 64 + 128 * 192 + 2 * 128
TABLE = 2048 * 128  # the TP-local embedding or output block


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "hsdp_tp": ("llama3_debug_gift_fsdp2", [*HSDP_TP, *NVFP4]),
        "hsdp_tp_fp32": ("llama3_debug_gift_fsdp2", [*HSDP_TP, *FP32]),
        "hsdp_tp_off": ("llama3_debug_nogift_fsdp2", HSDP_TP),
        "pp_tp": ("llama3_debug_gift_fsdp2", [*PP_TP, *NVFP4]),
        "pp_tp_fp32": ("llama3_debug_gift_fsdp2", [*PP_TP, *FP32]),
        "pp_tp_off": ("llama3_debug_nogift_fsdp2", PP_TP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=8)


def _steps(records: list[dict]) -> list[dict]:
    steps = [r for r in records if "gift/wire_bytes_per_step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def _assert_tp_blocks(run: RunResult, managed: int, group: int) -> None:
    """Each managed weight is this TP rank's block (colwise rows halved, rowwise columns halved),
    its statistics reduced over the data-parallel group of `group` ranks, never over TP."""
    blocks = re.findall(rf"GIFT TP: {managed} managed weights are this TP rank's blocks, each its own GIFT matrix "
                        rf"with statistics reduced over the {group}-rank data-parallel group: (.*)", run.output)
    assert blocks, run.output[-3000:]
    assert all(re.search(r"attention\.wo\.weight \[128, 128\] -> \[128, 64\]", b) for b in blocks)
    assert all(re.search(r"feed_forward\.w1\.weight \[384, 128\] -> \[192, 128\]", b) for b in blocks)


def _assert_tracks_gift_off(gift: RunResult, off: RunResult) -> None:
    g, o = gift.losses(), off.losses()
    assert sorted(g) == sorted(o) == list(range(1, STEPS + 1))
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_hsdp_tp_reduces_each_tp_block_over_shards_then_replicas_at_nvfp4(runs: Callable[[str], RunResult]) -> None:
    gift, exact, off = runs("hsdp_tp"), runs("hsdp_tp_fp32"), runs("hsdp_tp_off")
    assert REFUSAL not in gift.output and not gift.gift_warnings()
    assert "fully_shard on the shard-only mesh (fsdp=2)" in gift.output
    assert "replica hop (all-reduce of each reduced shard over 2 replicas) at nvfp4" in gift.output
    _assert_tp_blocks(gift, managed=20, group=4)  # the state spans shards x replicas
    tp_local = 2 * TABLE + 4 * BLOCK + 128  # this TP rank's fp32 gradient elements (final norm included)
    fp32_replica = exact.last("gift/replica_wire_bytes_per_step")
    for r in _steps(gift.records):
        # each hop hands its collectives (counted at run time) exactly what its plans account for
        assert r["gift/wire_bytes_per_step"] == r["gift/shard_accounted_bytes_per_backward"], r
        assert r["gift/replica_wire_bytes_per_step"] == r["gift/replica_accounted_bytes_per_backward"], r
        # the shard hop carries the TP-local gradients, the replica hop the reduced half of them
        assert r["gift/baseline_bytes_per_step"] == 4 * tp_local, r
        assert r["gift/replica_baseline_bytes_per_step"] == 4 * tp_local // 2, r
        assert r["gift/collectives_per_step"] == r["gift/replica_collectives_per_step"] == 6, r
        assert r["gift/total_compression"] > 1.5, r
        assert r["gift/replica_wire_bytes_per_step"] < 0.7 * fp32_replica, (r, fp32_replica)
    # both hops' round-trip error at nvfp4: the shard hop's at the refresh, the replica hop's probed (pooled
    # with the bf16 items of the whole gradient, so under nvfp4's own level; a raw hop gives 0)
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    errs = [r["gift/replica_err"] for r in gift.records if "gift/replica_err" in r]
    assert len(errs) == STEPS - 1 and all(0.005 < e < 0.3 for e in errs), errs
    _assert_tracks_gift_off(gift, off)


def test_hsdp_tp_at_fp32_on_both_hops_is_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("hsdp_tp_fp32"), runs("hsdp_tp_off")
    assert REFUSAL not in exact.output and not exact.gift_warnings()
    for r in _steps(exact.records):
        assert r["gift/wire_bytes_per_step"] == r["gift/shard_accounted_bytes_per_backward"], r
        assert r["gift/replica_wire_bytes_per_step"] == r["gift/replica_accounted_bytes_per_backward"], r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert all(r["gift/replica_err"] == 0.0 for r in exact.records if "gift/replica_err" in r)
    assert exact.losses() == off.losses()


def test_pp_tp_fsdp_quantizes_each_stages_tp_blocks_at_nvfp4(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("pp_tp"), runs("pp_tp_off")
    assert REFUSAL not in gift.output and not gift.gift_warnings()
    _assert_tp_blocks(gift, managed=10, group=2)
    assert sorted(gift.stages) == [0, 1]
    # a stage's TP-local fp32 gradient elements: its table (embedding / output), two blocks,
    # and on the last stage the final norm
    baseline = {0: 4 * (TABLE + 2 * BLOCK), 1: 4 * (TABLE + 2 * BLOCK + 128)}
    for stage, records in gift.stages.items():
        assert f"GIFT: 10 weights managed on pipeline rank {stage} (1 model parts, data-parallel group of 2)" \
            in gift.output
        for r in _steps(records):
            assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"] > 0, (stage, r)
            assert r["gift/baseline_bytes_per_step"] == baseline[stage], (stage, r)
            assert r["gift/collectives_per_step"] == 3, (stage, r)
            assert r["gift/total_compression"] > 1.5, (stage, r)
        refresh = [r for r in records if "gift/refresh_step" in r]
        assert [r["step"] for r in refresh] == [2], (stage, refresh)
        layers = {k.removeprefix("gift/err_euclidean/") for k in refresh[0] if k.startswith("gift/err_euclidean/")}
        assert {int(re.match(r"layers\.(\d+)\.", n).group(1)) for n in layers} == {0: {0, 1}, 1: {2, 3}}[stage]
        assert 0.03 < refresh[0]["gift/err_euclidean_mean"] < 0.3, refresh[0]
    _assert_tracks_gift_off(gift, off)


def test_pp_tp_fsdp_at_fp32_is_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("pp_tp_fp32"), runs("pp_tp_off")
    assert REFUSAL not in exact.output and not exact.gift_warnings()
    for records in exact.stages.values():
        for r in _steps(records):
            assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert [r["gift/err_euclidean_mean"] for r in records if "gift/err_euclidean_mean" in r] == [0.0]
    assert exact.losses() == off.losses()
