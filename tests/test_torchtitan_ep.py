"""Expert parallelism with GIFT on the stock FSDP2 trainer, 4 gloo ranks (FSDP 4, EP 2).

The ``gift_moe_debug`` DeepSeek-V3 MoE (one dense block, two MoE blocks of 4 grouped-GEMM routed
experts, top-2, and a shared expert; see `gift_compile.torchtitan_ext.models`) under torchtitan's
``apply_fsdp_to_decoder`` with EP 2: every MoE block is one FSDP module with two parameter groups,
the routed experts on the 2-rank ``efsdp`` mesh, the rest (attention, router, shared expert) on
the 4-rank ``fsdp`` mesh. GIFT's reduce-scatter goes on the fsdp group of each MoE block (and on
every dense module); the experts stay on FSDP2's own reduce-scatter, and the EP all-to-all on the
token dispatcher is not touched (GIFT only replaces FSDP2's reduce-scatter comm).

Three runs, same seed, init and data, ``--gift.unrewritten warn`` (without it GIFT refuses the run
naming the expert modules: the unit test at the end): GIFT at nvfp4 (a refresh after step 2),
GIFT at fp32 and GIFT off (EP with TP or PP: tests/test_torchtitan_ep_layouts.py). nvfp4 must
quantize the dense linears (bytes counted at the collective == the plans' accounting, fewer than
fp32's, a round-trip error > 0), hand GIFT exactly the dense
parameters' fp32 gradients as its baseline (none of the experts'), name each expert module in a
warning, and stay within the 2-rank tests' loss tolerance of GIFT off; fp32 must reproduce GIFT
off's losses exactly. Measured 2026-12-05 on 2 cores shared with other jobs: the file 150 s at load
4-8, 170 s at load 12-17 (``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.frameworks.fsdp2 import OutsideGroup, refuse_outside  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.models import MOE_FLAVORS  # noqa: E402
from gift_compile.torchtitan_ext.runs import RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
EP = ["--parallelism.data-parallel-shard-degree=4", "--parallelism.expert-parallel-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse", "--gift.unrewritten=warn"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=nvfp4"]),
        "fp32": ("moe_debug_gift_fsdp2", [*EP, *GIFT, "--gift.format=fp32"]),
        "off": ("moe_debug_nogift_fsdp2", EP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def _assert_experts_named_and_nothing_else(run: RunResult,
                                           route: str = r"reduce-scatters over mesh 'efsdp' \(2 ranks\)") -> None:
    """Each routed-expert module is named in a warning (full precision, not managed; `route`: how
    its gradients travel), nothing else GIFT logs is a warning or a fallback, and no layout was
    refused."""
    assert REFUSAL not in run.output
    warnings = run.gift_warnings()
    assert warnings, run.output[-3000:]
    for line in warnings:
        found = re.search(rf"GIFT: (\S+) \(GroupedExperts\) {route} at full precision, not managed: "
                          r".*grouped-GEMM expert weight", line)
        assert found and found.group(1) in EXPERTS, line
    assert {m for m in EXPERTS if any(m in line for line in warnings)} == set(EXPERTS)


def _dense_elements(run: RunResult) -> int:
    """The model's parameters less the routed experts' (3 grouped weights of [E, hidden, dim])."""
    total = int(re.search(r"gift_moe_debug size: ([\d,]+) total parameters", run.output).group(1).replace(",", ""))
    size = MOE_FLAVORS["gift_moe_debug"]
    experts = ((size["n_layers"] - size["n_dense_layers"]) * 3 * size["num_experts"] * size["moe_hidden_dim"]
               * size["dim"])
    return total - experts


def test_ep_quantizes_the_dense_layers_at_nvfp4_and_leaves_the_experts_at_full_precision(
        runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("nvfp4"), runs("off")
    _assert_experts_named_and_nothing_else(gift)
    managed = re.search(r"GIFT: (\d+) weights managed \((.*)\)", gift.output)
    assert managed and int(managed.group(1)) == 18, gift.output[-3000:]
    names = managed.group(2).split(", ")
    # the MoE blocks' dense group: attention and shared expert linears are GIFT matrices
    for name in ("layers.1.attention.wkv_b.weight", "layers.2.attention.wo.weight",
                 "layers.1.moe.shared_experts.w1.weight", "layers.2.moe.shared_experts.w2.weight",
                 "layers.0.feed_forward.w3.weight"):
        assert name in names
    assert not [n for n in names if "routed_experts" in n]
    dense = _dense_elements(gift)
    for r in logged_steps(gift, STEPS):
        # GIFT's reduce-scatters carry exactly the dense parameters' gradients (fp32 baseline), none of the experts'
        assert r["gift/baseline_bytes_per_step"] == 4 * dense, r
        # bytes handed to GIFT's reduce-scatters (counted at run time) == the plans' accounting, < fp32
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.9 * r["gift/baseline_bytes_per_step"], r
        # one per FSDP module on the fsdp mesh: embeddings, the dense block, the two MoE blocks' dense
        # groups, norm + head
        assert r["gift/collectives_per_step"] == 5, r
        # the routed experts' 3 weights per MoE block on FSDP2's own reduce-scatter over efsdp
        assert r["gift/full_precision_params"] == 6, r
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_experts_named_and_nothing_else(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/baseline_bytes_per_step"] == 4 * _dense_elements(exact), r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


_EXPERT_GROUP = OutsideGroup(
    modules=("layers.1.moe.routed_experts.inner_experts",), kinds=("GroupedExperts",),
    params=tuple((f"layers.1.moe.routed_experts.inner_experts.{w}", (4, 64, 64))
                 for w in ("w1_EFD", "w2_EDF", "w3_EFD")),
    group="efsdp", ranks=2)


def test_experts_outside_gift_are_refused_by_name_unless_configured(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.routed_experts\.inner_experts \(GroupedExperts\) over mesh "
                                         r"'efsdp' \(2 ranks\) would travel at full precision: .*per-parameter mesh"
                                         r".*3-D tensor.*unrewritten='warn'"):
        refuse_outside([_EXPERT_GROUP], "error")
    with caplog.at_level(logging.INFO, logger="gift_compile.frameworks.fsdp2"):
        refuse_outside([_EXPERT_GROUP], "warn")
        # EP = the whole fsdp mesh: one expert shard per rank, efsdp of one rank, no gradient collective
        refuse_outside([_EXPERT_GROUP._replace(ranks=1)], "error")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "layers.1.moe.routed_experts.inner_experts (GroupedExperts) reduce-scatters over mesh 'efsdp'" in \
        caplog.records[0].getMessage()
    assert "crosses no rank" in caplog.records[1].getMessage()
    # under HSDP a one-rank efsdp group still crosses the replicas (the fp32 all-reduce native HSDP would run)
    hsdp = _EXPERT_GROUP._replace(ranks=1, replicas=2)
    with pytest.raises(ValueError, match=r"inner_experts \(GroupedExperts\) over mesh 'efsdp' \(one rank, then 2 "
                                         r"replicas\) would travel at full precision: .*all-reduced over the replicas"):
        refuse_outside([hsdp], "error")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gift_compile.frameworks.fsdp2"):
        refuse_outside([hsdp], "warn")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert ("inner_experts (GroupedExperts) is sharded over mesh 'efsdp' (one rank) and all-reduces over 2 replicas "
            "at full precision") in caplog.records[0].getMessage()
