"""HSDP with GIFT on torchtitan's two trainers, 4 gloo ranks (2 replicas x 2 shards).

FSDP2: two GIFT runs (shard hop fp8_e4m3 and replica hop nvfp4, with a refresh after step 2 so
step 3 runs the measured selection on both hops; both hops fp32) and one GIFT-off run with
torchtitan's native HSDP, same seed and data (~20-60 s each on a 2-core box). graph_trainer: one
GIFT run (fp8_e4m3 / nvfp4, a refresh after step 2 and the retrace it causes) and one GIFT-off
run with SimpleFSDP's native HSDP (~1-3 min each). Tolerance: the 2-rank tests' 5e-3 per step;
fp32 on both hops must reproduce native HSDP's losses exactly (FSDP2 here; the graph rewrite's
fp32 exactness and each hop's error at its format are checked on a hand-made graph in
test_pass_hsdp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import re

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.hooks import REFUSAL, data_parallel_group  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402

STEPS = 3
HSDP = ["--parallelism.data-parallel-replicate-degree=2", "--parallelism.data-parallel-shard-degree=2",
        "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.format=fp8_e4m3", "--gift.replica-format=nvfp4", "--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "gift": ("llama3_debug_gift_fsdp2", [*HSDP, *GIFT]),
        "graph": ("llama3_debug_gift_graph", [*HSDP, *GIFT]),
        "graph_off": ("llama3_debug_nogift_graph", HSDP),
        "gift_fp32": ("llama3_debug_gift_fsdp2", [*HSDP, *EXACT_FP32, "--gift.no-fuse",
                                                  "--gift.replica-format=fp32"]),
        "off": ("llama3_debug_nogift_fsdp2", HSDP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def test_fsdp2_hsdp_runs_both_hops_at_their_formats_and_tracks_fp32(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("gift"), runs("off")
    assert "fully_shard on the shard-only mesh" in gift.output
    assert "replica hop (all-reduce of each reduced shard over 2 replicas) at nvfp4" in gift.output
    # no refusal, no weight left at full precision, no GIFT warning (fallbacks are logged as such)
    assert REFUSAL not in gift.output
    assert not gift.gift_warnings()
    steps = [r for r in gift.records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        # bytes each hop handed to its collectives (counted at run time) == the plans' accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/shard_accounted_bytes_per_backward"], r
        assert r["gift/replica_wire_bytes_per_step"] == r["gift/replica_accounted_bytes_per_backward"], r
        assert r["gift/collectives_per_step"] == r["gift/replica_collectives_per_step"] == 6
        assert r["gift/total_compression"] > 1.3 and r["gift/replica_compression"] > 1.0, r
    # the replica hop's error, probed against an fp32 all-reduce from step 2 on: pooled over every coded
    # item of the hop, the layers at nvfp4 and (whole gradient) the embedding, head and norms at bf16, so
    # under nvfp4's own level; a raw hop gives 0
    errs = [r["gift/replica_err"] for r in steps if "gift/replica_err" in r]
    assert len(errs) == STEPS - 1 and all(0.005 < e < 0.3 for e in errs), errs
    assert gift.last("gift/refresh_step") == 2
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1]  # same init, data and forward: the layouts differ only in the gradient path
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


def test_fsdp2_hsdp_at_fp32_on_both_hops_is_native_hsdp(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("gift_fp32"), runs("off")
    assert exact.losses() == off.losses()
    assert all(r["gift/replica_err"] == 0.0 for r in exact.records if "gift/replica_err" in r)
    assert exact.last("gift/replica_wire_bytes_per_step") == exact.last("gift/replica_accounted_bytes_per_backward")


def test_graph_hsdp_rewrites_both_hops_at_their_formats_and_tracks_fp32(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("graph"), runs("graph_off")
    assert ("shard hop (each bucketed reduce-scatter over 2 ranks) at fp8_e4m3, then replica hop (all-reduce of "
            "the reduced shard over 2 replicas) at nvfp4") in gift.output
    assert REFUSAL not in gift.output
    assert not gift.gift_warnings()
    # the rewrite log: each block's bucket is one GIFT reduce-scatter then one GIFT all-reduce of
    # the reduced shard (SimpleFSDP's 7 replica all-reduces + 1 reduce-scatter per block become
    # 2 all_to_alls + 1 all_gather), 0 fallbacks; every trace (the first and the retrace after the
    # refresh's selection) logs the same figures
    found = re.findall(
        r"GIFT rewrite: 4 reduce-scatters \(4 buckets\) carrying 20 managed weights, 0 fallbacks; collective "
        r"launches per step (\d+) -> (\d+); bytes per step of the rewritten collectives (\d+) -> (\d+); replica "
        r"hop \(HSDP\): 4 all-reduces of the reduced shards after them, bytes per step (\d+) -> (\d+)", gift.output)
    assert found, gift.output[-3000:]
    before, after, base, wire, replica_base, replica_wire = map(int, found[-1])
    assert before - after == 4 * (8 - 3), (before, after)
    assert wire < base and replica_wire < replica_base
    steps = [r for r in gift.records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        # bytes each hop handed to its collectives (counted at run time) == the pass's accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/shard_accounted_bytes_per_backward"] == wire, r
        assert r["gift/baseline_bytes_per_step"] == base, r
        assert r["gift/replica_wire_bytes_per_step"] == r["gift/replica_accounted_bytes_per_backward"] == replica_wire, r
        assert r["gift/replica_baseline_bytes_per_step"] == replica_base, r
        assert r["gift/collectives_per_step"] == r["gift/replica_collectives_per_step"] == 4
    # the shard hop's error at the refresh (per-layer round trip at fp8_e4m3)
    assert gift.last("gift/refresh_step") == 2
    assert 0.005 < gift.last("gift/err_euclidean_mean") < 0.08
    # replicas still hold bit-identical shards after GIFT-reduced optimizer steps
    assert "GIFT HSDP: replicas bit-identical after 2 optimizer steps" in gift.output
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1]
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


@pytest.mark.parametrize("trainer,dims,names", [
    ("graph", {"pp": 2, "cp": 2}, "pipeline on graph_trainer parallelism is on .*use the FSDP2 trainer"),
    ("graph", {"ep": 2, "cp": 2}, "expert with context parallelism is on .*without GIFT either"),
    ("fsdp2", {"ep": 2, "dp_replicate": 2, "cp": 2}, "expert with context parallelism is on .*without GIFT either"),
    ("fsdp2", {"dp_shard": 1}, "needs more than one data-parallel rank: FSDP2 copies a one-rank shard's gradient"),
])
def test_layouts_gift_does_not_run_are_refused_by_name(trainer: str, dims: dict[str, int], names: str) -> None:
    parallel_dims = SimpleNamespace(**{"tp": 1, "cp": 1, "pp": 1, "ep": 1, "dp_replicate": 1, "dp_shard": 2, **dims})
    with pytest.raises(ValueError, match=names):
        data_parallel_group(parallel_dims, trainer)


@pytest.mark.parametrize("flag,shard_only", [("--gift.enable", True), ("--gift.no-enable", False)])
def test_shard_only_mesh_follows_the_final_gift_enable(flag: str, shard_only: bool) -> None:
    """Only a run whose final config enables GIFT shards on the shard-only mesh: without GIFT's
    replica hop nothing else would all-reduce across replicas (the replicas would drift apart)."""
    from torchtitan.config import ConfigManager

    from gift_compile.torchtitan_ext.hsdp import ShardOnlyDims, shard_only_parallelize

    config = ConfigManager().parse_args(["--module", "gift_compile.torchtitan_ext.cpu", "--config",
                                         "llama3_debug_gift_fsdp2", flag])
    fn = config.model_spec.parallelize_fn
    assert fn.func is shard_only_parallelize
    seen = []
    dims = SimpleNamespace(dp_replicate_enabled=True, dp_shard=2, dp_replicate=2, cp=1)
    fn("model", parallel_dims=dims, inner=lambda model, parallel_dims: seen.append(parallel_dims))
    assert isinstance(seen[0], ShardOnlyDims) is shard_only
    assert seen[0].dp_replicate_enabled is not shard_only and seen[0].dp_shard == 2
