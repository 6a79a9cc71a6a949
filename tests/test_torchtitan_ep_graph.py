"""Expert parallelism with GIFT on torchtitan's graph_trainer, 4 gloo ranks (FSDP 4, EP 2).

The ``gift_moe_debug`` DeepSeek-V3 MoE (see `gift_compile.torchtitan_ext.cpu.models`) under graph_trainer's
``apply_simple_fsdp`` with EP 2: the routed experts (grouped-GEMM 3-D weights) are wrapped on the
2-rank ``efsdp`` mesh, everything else on the 4-rank ``fsdp`` mesh. The GIFT pass rewrites the
fsdp-mesh bucketed reduce-scatters that carry the marked dense linears (attention, shared experts,
the dense block) and the experts' efsdp reduce-scatters, whose gradients GIFT marks with a
Euclidean plan (`gift_compile.frameworks.simple_fsdp.mark_outside`: each grouped weight
`[2 local experts, 64, 64]` one item `[128, 64]`, no map, as FSDP2 sends them), into GIFT's
collective over that group; the EP all-to-alls are not touched (the rewrite log counts them
before and after, and the collectives it rewrote over efsdp).

Four runs, same seed, init and data, with the default ``--gift.unrewritten error`` (nothing is
refused): GIFT at nvfp4 (a refresh after step 2, error feedback on: each rank's experts' residuals
must be in its checkpoint), GIFT at fp32, GIFT at nvfp4 with the experts
excluded (their reduce-scatters then stay as traced, at fp32, counted in
``gift/full_precision_params``) and GIFT off. nvfp4 must quantize the dense linears and the
experts (their fp32 gradients in GIFT's baseline, bytes counted at the collective == the pass's
accounting, the experts' bytes at least 80% fewer than their fp32 bytes, a round-trip error > 0,
losses within the 2-rank tests' tolerance of GIFT off); fp32 must reproduce GIFT off's losses
exactly. A fifth run, EP x TP (dp_shard 2 x tp 2, EP 2) at nvfp4: the experts' efsdp group then
holds the same ranks as GIFT's fsdp group but is another mesh, and its reduce-scatters must be
rewritten as well (its losses against GIFT off are a row of `bench.cluster.layouts`). Three more, EP x HSDP
(dp_replicate 2 x dp_shard 2, EP 2: efsdp has one rank, so SimpleFSDP traces no reduce-scatter
for the experts, only their all-reduce over dp_replicate) at nvfp4, fp32 and GIFT off, with the
default ``--gift.unrewritten error``: nothing is refused, the pass makes each expert weight's
all-reduce GIFT's replica hop alone (`simple_fsdp.set_replica_hop`), whose bytes count with the
dense layers' replica hop (counted == accounted per hop, nvfp4 under 30% of fp32's), and fp32
reproduces GIFT off's losses exactly. Measured 2026-12-06 on 2 cores shared with other jobs
(load 4-8): the file 464 s before the EP x HSDP runs, 746 s with them (load about 7)
(``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep_graph.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from gift_compile.frameworks.simple_fsdp import OutsideGroup, _why_not_carried, refuse_outside  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.cpu.models import MOE_FLAVORS  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_expert_residuals_checkpointed, assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
EP = ["--parallelism.data-parallel-shard-degree=4", "--parallelism.expert-parallel-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
EP_TP = ["--parallelism.data-parallel-shard-degree=2", "--parallelism.tensor-parallel-degree=2",
         *EP[1:]]
EP_HSDP = ["--parallelism.data-parallel-replicate-degree=2", "--parallelism.data-parallel-shard-degree=2", *EP[1:]]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
EXPERTS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("moe_debug_gift_graph", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.error-feedback",
                                           "--checkpoint.enable", f"--checkpoint.interval={STEPS}"]),
        "fp32": ("moe_debug_gift_graph", [*EP, *GIFT, *EXACT_FP32]),
        # the routed experts excluded (GiftConfig.exclude) and sent raw (`excluded_format=fp32`, the
        # opt-out; the default would send them at bf16): unmarked, their traced reduce-scatters stay fp32
        "raw_experts": ("moe_debug_gift_graph", [*EP, *GIFT, "--gift.format=nvfp4", "--gift.excluded-format=fp32",
                                                 "--gift.exclude=*embed*,*output*,*lm_head*,*routed_experts*"]),
        "off": ("moe_debug_nogift_graph", EP),
        "tp_nvfp4": ("moe_debug_gift_graph", [*EP_TP, *GIFT, "--gift.format=nvfp4", "--gift.min-numel=1024"]),
        "hsdp_nvfp4": ("moe_debug_gift_graph", [*EP_HSDP, *GIFT, "--gift.format=nvfp4"]),
        "hsdp_fp32": ("moe_debug_gift_graph", [*EP_HSDP, *GIFT, *EXACT_FP32]),
        "hsdp_off": ("moe_debug_nogift_graph", EP_HSDP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


# how the experts' log line says they cross ranks: reduce-scattered over efsdp, or under EP x HSDP
# (efsdp of one rank) all-reduced over the replicas by GIFT's replica hop alone
ON_EFSDP = r"reduce-scatters over mesh 'efsdp' \(2 ranks\)"
ON_REPLICAS = (r"is sharded over mesh 'dp_replicatexefsdp' with one rank along its shard dim \(no reduce-scatter\): "
               r"GIFT's replica hop all-reduces its gradient over the 2 replicas")
# how the pass logs experts it leaves on their traced fp32 collective (excluded and sent raw, or
# every format at fp32: the opt-out is raw bytes, and on this path the experts are outside GIFT's layers)
UNMARKED_ON_EFSDP = r"reduce-scatters over mesh 'efsdp' \(2 ranks\)"
UNMARKED_ON_REPLICAS = r"reduces over mesh 'dp_replicatexefsdp' \(2 ranks\)"


def _assert_experts_on_gift(run: RunResult, items: str, sent: str = ON_EFSDP) -> None:
    """Each routed-expert module is named in one warning saying its three grouped weights go on
    GIFT's codec with no map, as `sent` says, as `items` (a warning: the run's geometry has a
    map they go without), nothing else GIFT logs is a warning or a fallback, and no layout was
    refused."""
    assert REFUSAL not in run.output
    lines = [line for line in run.output.splitlines() if "(GroupedExperts)" in line]
    found = {m.group(1) for line in lines
             if (m := re.search(rf"WARNING .*GIFT: (\S+) \(GroupedExperts\) {sent} on GIFT's codec with no map.*: "
                                rf"{items}", line))}
    assert found == set(EXPERTS), "\n".join(lines) or run.output[-3000:]
    warnings = run.gift_warnings()
    assert warnings and all("(GroupedExperts)" in line for line in warnings), warnings


def _unmarked(run: RunResult, sent: str) -> set[str]:
    """The routed-expert modules the pass logged as left unmarked on their traced collective
    (`sent` says which), their three grouped weights at full precision; no layout refused."""
    assert REFUSAL not in run.output
    return {m.group(1) for line in run.output.splitlines()
            if (m := re.search(rf"INFO .*GIFT: (\S+) \(GroupedExperts\) {sent} unmarked, at full precision .*: "
                               r"w1_EFD, w2_EDF, w3_EFD$", line))}


def _quantized(fmt: str) -> str:
    """`_assert_experts_on_gift`'s items: each grouped weight as [2 local experts x 64 rows, 64]."""
    return ", ".join(f"{w} as \\[128, 64\\] at {fmt}" for w in ("w1_EFD", "w2_EDF", "w3_EFD"))


def _rewrite_logs(run: RunResult, efsdp: tuple[int, int], replicas: tuple[int, int] | None = None) -> None:
    """Every rewrite log counts the EP all-to-alls, forward and backward, before and after the
    rewrite: there are some, and they did not change; and says it rewrote `efsdp` (collectives,
    weights) over the efsdp group (the experts' reduce-scatters) and, under HSDP, `replicas` over
    the experts' dp_replicate group (their replica all-reduces, each its gradient's only one)."""
    logs = [line for line in run.output.splitlines() if "GIFT rewrite:" in line]
    assert logs, run.output[-3000:]
    for line in logs:
        found = re.search(r"; EP collectives left as they were: forward (\d+) -> (\d+), backward (\d+) -> (\d+)", line)
        assert found, line
        fwd, fwd_after, bwd, bwd_after = map(int, found.groups())
        assert fwd == fwd_after and bwd == bwd_after and bwd > 0, found.group(0)
        found = re.search(r"; efsdp collectives rewritten: (\d+) carrying (\d+) weights", line)
        assert found and tuple(map(int, found.groups())) == efsdp, line
        found = re.search(r"; experts' dp_replicate collectives rewritten: (\d+) carrying (\d+) weights", line)
        assert (tuple(map(int, found.groups())) if found else None) == replicas, line
        if replicas is not None:
            assert f"and {replicas[0]} of gradients with a one-rank shard group (their only collective)" in line, line


def _elements(run: RunResult, ep: int = 2) -> tuple[int, int]:
    """The transformer blocks' parameters less the routed experts' (what the fsdp buckets with a
    managed weight carry: the embeddings, final norm and head reduce-scatter in buckets of their
    own, which GIFT leaves as they are), and the routed experts' on one EP rank (3 grouped
    weights of [E / ep, hidden, dim] per MoE block: what the efsdp reduce-scatters carry)."""
    total = int(re.search(r"gift_moe_debug size: ([\d,]+) total parameters", run.output).group(1).replace(",", ""))
    size = MOE_FLAVORS["gift_moe_debug"]
    experts = ((size["n_layers"] - size["n_dense_layers"]) * 3 * size["num_experts"] * size["moe_hidden_dim"]
               * size["dim"])
    return total - experts - 2 * size["vocab_size"] * size["dim"] - size["dim"], experts // ep


def test_ep_on_graph_quantizes_the_dense_layers_and_the_experts_at_nvfp4(runs: Callable[[str], RunResult]) -> None:
    gift, off, raw = runs("nvfp4"), runs("off"), runs("raw_experts")
    _assert_experts_on_gift(gift, _quantized("nvfp4"))
    _rewrite_logs(gift, (2, 6))
    managed = re.search(r"GIFT: (\d+) weights managed \((.*)\)", gift.output)
    assert managed and int(managed.group(1)) == 18, gift.output[-3000:]
    names = managed.group(2).split(", ")
    for name in ("layers.1.attention.wkv_b.weight", "layers.2.attention.wo.weight",
                 "layers.1.moe.shared_experts.w1.weight", "layers.2.moe.shared_experts.w2.weight",
                 "layers.0.feed_forward.w3.weight"):
        assert name in names
    assert not [n for n in names if "routed_experts" in n]
    dense, experts = _elements(gift)
    for r in logged_steps(gift, STEPS):
        # the rewritten reduce-scatters carry the blocks' dense gradients and this EP rank's experts'
        assert r["gift/baseline_bytes_per_step"] == 4 * (dense + experts), r
        # bytes handed to GIFT's collectives (counted at run time) == the pass's accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        # one bucketed reduce-scatter per transformer block on the fsdp mesh, one per MoE block on efsdp
        assert r["gift/collectives_per_step"] == 5, r
        assert "gift/full_precision_params" not in r, r
    # excluded, the experts stay unmarked on their traced fp32 reduce-scatters (logged, counted),
    # outside GIFT's figures; quantized, they add under 20% of their fp32 bytes to GIFT's
    assert _unmarked(raw, UNMARKED_ON_EFSDP) == set(EXPERTS), raw.output[-3000:]
    _rewrite_logs(raw, (0, 0))
    for r, f in zip(logged_steps(gift, STEPS), logged_steps(raw, STEPS)):
        assert f["gift/baseline_bytes_per_step"] == 4 * dense, f
        assert f["gift/full_precision_params"] == 6, f
        assert f["gift/collectives_per_step"] == 3, f
        assert r["gift/wire_bytes_per_step"] - f["gift/wire_bytes_per_step"] < 0.2 * 4 * experts, (r, f)
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_on_graph_keeps_each_ranks_expert_residuals_and_checkpoints_them(
        runs: Callable[[str], RunResult]) -> None:
    """The marks carry each grouped weight's residual (the state's, `add_outside_residual`) and the
    rewritten efsdp reduce-scatters write it, as the FSDP2 trainer's comm does."""
    assert_expert_residuals_checkpointed(runs("nvfp4"), EXPERTS, STEPS)


def test_ep_on_graph_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    """Every format at fp32 (`EXACT_FP32`): the dense layers go on GIFT's rewritten reduce-scatters
    at fp32, the routed experts (outside GIFT's layers on this path, where fp32 is the raw opt-out)
    stay unmarked on their traced fp32 reduce-scatters, counted as full precision; the losses are
    GIFT off's exactly."""
    exact, off = runs("fp32"), runs("off")
    assert _unmarked(exact, UNMARKED_ON_EFSDP) == set(EXPERTS), exact.output[-3000:]
    _rewrite_logs(exact, (0, 0))
    dense, _ = _elements(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/baseline_bytes_per_step"] == 4 * dense, r
        assert r["gift/full_precision_params"] == 6, r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_experts_the_pass_cannot_carry_are_refused_by_name_unless_configured(
        caplog: pytest.LogCaptureFixture) -> None:
    """What the pass cannot carry (a shard on dim 1, with or without HSDP's replicas; a
    placement without a shard) is refused by name with its reason, or with "warn" logged per
    module; what it carries (a dim-0 shard, under HSDP after a replicated dim, whose all-reduce
    GIFT's replica hop takes) has no reason and is not refused; a one-rank group sends nothing
    and is only logged."""
    assert _why_not_carried((Shard(0),)) == "" and _why_not_carried((Replicate(), Shard(0))) == ""
    dim1 = _why_not_carried((Replicate(), Shard(1)))
    assert "dim 1" in dim1 and _why_not_carried((Shard(1),)) == dim1
    assert "not as a shard" in _why_not_carried((Replicate(),))
    assert "not as a shard" in _why_not_carried((Replicate(), Replicate(), Shard(0)))
    group = OutsideGroup(modules=("layers.1.moe.routed_experts.inner_experts",), kinds=("GroupedExperts",),
                         params=tuple((f"layers.1.moe.routed_experts.inner_experts.{w}", (4, 64, 64))
                                      for w in ("w1_EFD", "w2_EDF", "w3_EFD")), group="dp_replicatexefsdp", ranks=2,
                         why=dim1, replicas=2)
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.routed_experts\.inner_experts \(GroupedExperts\) "
                                         r"over mesh 'dp_replicatexefsdp' \(2 ranks\): SimpleFSDP shards them on dim 1"
                                         r".*would travel at full precision.*unrewritten='warn'.*FSDP2 trainer"):
        refuse_outside([group], "error")
    with caplog.at_level(logging.INFO, logger="gift_compile.frameworks.simple_fsdp"):
        refuse_outside([group._replace(why="")], "error")
        refuse_outside([group], "warn")
        refuse_outside([group._replace(ranks=1)], "error")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert ("layers.1.moe.routed_experts.inner_experts (GroupedExperts) reduces over mesh 'dp_replicatexefsdp' (2 "
            "ranks) at full precision, not carried: SimpleFSDP shards them on dim 1") in caplog.records[0].getMessage()
    assert "crosses no rank" in caplog.records[1].getMessage()


def test_ep_with_tp_on_graph_rewrites_the_experts_whose_group_has_gift_s_ranks(
        runs: Callable[[str], RunResult]) -> None:
    gift = runs("tp_nvfp4")
    _assert_experts_on_gift(gift, _quantized("nvfp4"))
    _rewrite_logs(gift, (2, 6))
    for r in logged_steps(gift, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.3 * r["gift/baseline_bytes_per_step"], r
        assert r["gift/collectives_per_step"] == 5, r
        assert "gift/full_precision_params" not in r, r


def test_ep_with_hsdp_on_graph_sends_the_experts_replica_all_reduce_on_gift_s_codec(
        runs: Callable[[str], RunResult]) -> None:
    """EP x HSDP with the default ``unrewritten="error"``: not refused. The experts' only
    collective, SimpleFSDP's all-reduce over dp_replicate, is GIFT's replica hop at nvfp4 (their
    fp32 bytes in the hop's baseline beside the dense layers' reduced shards); each hop counts
    what the pass accounts; the hop sends under 30% of the fp32 run's bytes; losses track GIFT off."""
    gift, off = runs("hsdp_nvfp4"), runs("hsdp_off")
    _assert_experts_on_gift(gift, _quantized("nvfp4"), ON_REPLICAS)
    _rewrite_logs(gift, (0, 0), (6, 6))
    dense, experts = _elements(gift)
    for r in logged_steps(gift, STEPS):
        assert r["gift/baseline_bytes_per_step"] == 4 * dense, r  # the shard hop: the dense layers only
        # the replica hop: the dense layers' reduced shards (2 shards) and this EP rank's experts, whole
        assert r["gift/replica_baseline_bytes_per_step"] == 4 * (dense // 2 + experts), r
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/replica_wire_bytes_per_step"] == r["gift/replica_accounted_bytes_per_backward"], r
        # one bucketed reduce-scatter per transformer block; its replica all-reduce, and one per expert weight
        assert r["gift/collectives_per_step"] == 3 and r["gift/replica_collectives_per_step"] == 9, r
        assert "gift/full_precision_params" not in r, r
        # GIFT's all-reduce hands over its reduce-scatter and all-gather stages' codes: at fp32 that
        # would be twice the baseline; at nvfp4 (4.5 bits) with the norms at bf16 it is under 0.6x
        assert r["gift/replica_wire_bytes_per_step"] < 0.6 * r["gift/replica_baseline_bytes_per_step"], r
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_ep_with_hsdp_on_graph_at_fp32_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    """At fp32 the experts' replica all-reduces stay unmarked (raw, as flat EP's reduce-scatters
    at fp32) and the dense layers' replica hop is GIFT's; the losses are GIFT off's exactly."""
    exact, off = runs("hsdp_fp32"), runs("hsdp_off")
    assert _unmarked(exact, UNMARKED_ON_REPLICAS) == set(EXPERTS), exact.output[-3000:]
    assert exact.losses() == off.losses()
