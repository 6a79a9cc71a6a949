"""Expert parallelism with GIFT on torchtitan's graph_trainer, 4 gloo ranks (FSDP 4, EP 2).

The ``gift_moe_debug`` DeepSeek-V3 MoE (see `gift_compile.torchtitan_ext.models`) under graph_trainer's
``apply_simple_fsdp`` with EP 2: the routed experts (grouped-GEMM 3-D weights) are wrapped on the
2-rank ``efsdp`` mesh, everything else on the 4-rank ``fsdp`` mesh. The GIFT pass rewrites the
fsdp-mesh bucketed reduce-scatters that carry the marked dense linears (attention, shared experts,
the dense block); the experts' efsdp reduce-scatters carry no mark and stay as traced, at full
precision, named per module (`gift_compile.frameworks.simple_fsdp.outside_gift`), and the EP
all-to-alls are not touched (the rewrite log counts both groups' collectives before and after).

Three runs, same seed, init and data, ``--gift.unrewritten warn`` (under the default GIFT refuses
the run naming the expert modules: the unit test at the end; the FSDP2 trainer sends them on
GIFT's codec instead, tests/test_torchtitan_ep.py): GIFT at nvfp4 (a refresh after step
2), GIFT at fp32 and GIFT off. nvfp4 must quantize the dense linears (bytes counted at the
collective == the pass's accounting, fewer than fp32's, a round-trip error > 0, losses that differ
from GIFT off after step 1 and stay within the 2-rank tests' tolerance); fp32 must reproduce GIFT
off's losses exactly. A fourth run, EP x TP (dp_shard 2 x tp 2, EP 2) at nvfp4, guards how the
experts are told apart there: their efsdp group then holds the same ranks as GIFT's fsdp group,
so only the mesh (its dimensions) says they are another collective; they must still be named.
(Its losses against GIFT off, and EP x HSDP on this trainer, are rows of `bench.layouts`.)
Measured 2026-12-05 on 2 cores shared with other jobs: the first three runs 350 s, the EP x TP run 55 s
(``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep_graph.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.frameworks.simple_fsdp import OutsideGroup, refuse_outside  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.models import MOE_FLAVORS  # noqa: E402
from gift_compile.torchtitan_ext.runs import RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
EP = ["--parallelism.data-parallel-shard-degree=4", "--parallelism.expert-parallel-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
EP_TP = ["--parallelism.data-parallel-shard-degree=2", "--parallelism.tensor-parallel-degree=2",
         *EP[1:]]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse", "--gift.unrewritten=warn"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("moe_debug_gift_graph", [*EP, *GIFT, "--gift.format=nvfp4"]),
        "fp32": ("moe_debug_gift_graph", [*EP, *GIFT, "--gift.format=fp32"]),
        "off": ("moe_debug_nogift_graph", EP),
        "tp_nvfp4": ("moe_debug_gift_graph", [*EP_TP, *GIFT, "--gift.format=nvfp4", "--gift.min-numel=1024"]),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def _assert_experts_named_and_nothing_else(run: RunResult) -> None:
    """Each routed-expert module is named in a warning (full precision, SimpleFSDP's reason),
    nothing else GIFT logs is a warning or a fallback, and no layout was refused."""
    assert REFUSAL not in run.output
    warnings = run.gift_warnings()
    assert warnings, run.output[-3000:]
    for line in warnings:
        found = re.search(r"GIFT: (\S+) \(GroupedExperts\) reduce-scatters over mesh 'efsdp' \(2 ranks\) at full "
                          r"precision, not managed: SimpleFSDP wraps them on another data-parallel mesh.*"
                          r"grouped-GEMM expert weight", line)
        assert found and found.group(1) in EXPERTS, line
    assert {m for m in EXPERTS if any(m in line for line in warnings)} == set(EXPERTS)


def _assert_ep_and_efsdp_untouched(run: RunResult) -> None:
    """The rewrite log counts the EP all-to-alls and the experts' efsdp collectives, forward
    and backward, before and after the rewrite: there are some, and they did not change."""
    for label in ("EP", "efsdp"):
        found = re.search(rf"; {label} collectives left as they were: forward (\d+) -> (\d+), backward (\d+) -> (\d+)",
                          run.output)
        assert found, run.output[-3000:]
        fwd, fwd_after, bwd, bwd_after = map(int, found.groups())
        assert fwd == fwd_after and bwd == bwd_after and bwd > 0, (label, found.group(0))


def _block_dense_elements(run: RunResult) -> int:
    """The transformer blocks' parameters less the routed experts' (3 grouped weights of
    [E, hidden, dim] per MoE block): what the buckets with a managed weight carry (the
    embeddings, final norm and head reduce-scatter in buckets of their own, which GIFT leaves as
    they are)."""
    total = int(re.search(r"gift_moe_debug size: ([\d,]+) total parameters", run.output).group(1).replace(",", ""))
    size = MOE_FLAVORS["gift_moe_debug"]
    experts = ((size["n_layers"] - size["n_dense_layers"]) * 3 * size["num_experts"] * size["moe_hidden_dim"]
               * size["dim"])
    return total - experts - 2 * size["vocab_size"] * size["dim"] - size["dim"]


def test_ep_on_graph_quantizes_the_dense_layers_at_nvfp4_and_leaves_the_experts_at_full_precision(
        runs: Callable[[str], RunResult]) -> None:
    gift, exact, off = runs("nvfp4"), runs("fp32"), runs("off")
    _assert_experts_named_and_nothing_else(gift)
    _assert_ep_and_efsdp_untouched(gift)
    managed = re.search(r"GIFT: (\d+) weights managed \((.*)\)", gift.output)
    assert managed and int(managed.group(1)) == 18, gift.output[-3000:]
    names = managed.group(2).split(", ")
    for name in ("layers.1.attention.wkv_b.weight", "layers.2.attention.wo.weight",
                 "layers.1.moe.shared_experts.w1.weight", "layers.2.moe.shared_experts.w2.weight",
                 "layers.0.feed_forward.w3.weight"):
        assert name in names
    assert not [n for n in names if "routed_experts" in n]
    fp32_wire = logged_steps(exact, STEPS)[0]["gift/wire_bytes_per_step"]
    for r in logged_steps(gift, STEPS):
        # the rewritten reduce-scatters carry exactly the blocks' dense gradients, none of the experts'
        assert r["gift/baseline_bytes_per_step"] == 4 * _block_dense_elements(gift), r
        # bytes handed to GIFT's collectives (counted at run time) == the pass's accounting, < fp32's
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.9 * fp32_wire, (r, fp32_wire)
        # one bucketed reduce-scatter per transformer block on the fsdp mesh
        assert r["gift/collectives_per_step"] == 3, r
        # the routed experts' 3 weights per MoE block stay on their traced efsdp reduce-scatters
        assert r["gift/full_precision_params"] == 6, r
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_on_graph_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_experts_named_and_nothing_else(exact)
    _assert_ep_and_efsdp_untouched(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/baseline_bytes_per_step"] == 4 * _block_dense_elements(exact), r
        assert r["gift/full_precision_params"] == 6, r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_experts_outside_the_pass_are_refused_by_name_unless_configured(caplog: pytest.LogCaptureFixture) -> None:
    """graph_trainer refuses the experts' traced reduce-scatters by name (SimpleFSDP's reason), or
    with "warn" logs them per module; a one-rank group sends nothing and is only logged."""
    group = OutsideGroup(modules=("layers.1.moe.routed_experts.inner_experts",), kinds=("GroupedExperts",),
                         params=tuple((f"layers.1.moe.routed_experts.inner_experts.{w}", (4, 64, 64))
                                      for w in ("w1_EFD", "w2_EDF", "w3_EFD")), group="efsdp", ranks=2)
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.routed_experts\.inner_experts \(GroupedExperts\) over mesh "
                                         r"'efsdp' \(2 ranks\) would travel at full precision: SimpleFSDP wraps them "
                                         r".*carry no GIFT mark.*3-D tensor.*unrewritten='warn'.*FSDP2 trainer"):
        refuse_outside([group], "error")
    with caplog.at_level(logging.INFO, logger="gift_compile.frameworks.simple_fsdp"):
        refuse_outside([group], "warn")
        refuse_outside([group._replace(ranks=1)], "error")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert ("layers.1.moe.routed_experts.inner_experts (GroupedExperts) reduce-scatters over mesh 'efsdp' (2 ranks) "
            "at full precision") in caplog.records[0].getMessage()
    assert "crosses no rank" in caplog.records[1].getMessage()


def test_ep_with_tp_on_graph_names_the_experts_whose_group_has_gift_s_ranks(runs: Callable[[str], RunResult]) -> None:
    gift = runs("tp_nvfp4")
    _assert_experts_named_and_nothing_else(gift)
    _assert_ep_and_efsdp_untouched(gift)
    for r in logged_steps(gift, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.3 * r["gift/baseline_bytes_per_step"], r
        assert r["gift/collectives_per_step"] == 3, r
    assert [r["gift/full_precision_params"] for r in gift.records if "gift/full_precision_params" in r] == [6.0] * STEPS
