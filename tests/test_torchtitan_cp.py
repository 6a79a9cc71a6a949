"""Context parallelism x FSDP with GIFT on torchtitan's two trainers, 4 gloo ranks (CP 2 x
dp_shard 2), and the CPU ring attention that lets torchtitan's CP run on CPU at all.

torchtitan folds dp_shard and cp into its ``fsdp`` mesh; FSDP2 (SimpleFSDP) reduce-scatters
every gradient over it and GIFT's state group is that mesh, so each CP rank's K-FAC statistics of
its slice of every sequence are summed with the other slices' at a refresh (that sum is checked against whole
sequences, with bit-identical transforms across CP ranks, in tests/test_context_parallel.py).
From one seed checkpoint, same data (~15-40 s each on a 2-core box): GIFT at nvfp4 with the
low-rank K-FAC geometry (the one that reads the input statistics; refreshes after steps 2 and 4,
every layer on the transformed path from step 3), GIFT at fp32 (measured selection), GIFT off,
GIFT off without CP on 2 ranks holding the same sequences whole (CP on CPU must train alike), and
on graph_trainer GIFT at nvfp4 as on the FSDP2 trainer (~2 min: the whole-step trace and its
retrace after the first refresh). nvfp4 must quantize, count at the
collective exactly the bytes its plans account for, and stay within the 2-rank tests' loss
tolerance of GIFT off; fp32 must reproduce GIFT off's losses exactly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from conftest import require
from multirank import run_ranks

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.hooks import REFUSAL, data_parallel_group  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, seed_checkpoint, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 4
CP = ["--parallelism.context-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse", "--gift.geometry=lowrank"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    # Every run starts from one seed checkpoint: on CPU torchtitan's initial weights depend on the
    # parallel layout (unseeded, 2 CP ranks start at loss 8.7554 where 1 rank on the same 4
    # sequences starts at 8.7805; from this checkpoint both start at 8.7805), so only a common
    # checkpoint makes the CP and non-CP runs comparable.
    start = seed_checkpoint(tmp_path_factory.mktemp("seed"))
    get = shared_runs({
        # select=all: after the refresh every layer's gradient goes through the map built from
        # the CP-summed sketches (step 3's gradient, seen in step 4's loss)
        "nvfp4": ("llama3_debug_gift_fsdp2", [*CP, *start, *GIFT, "--gift.format=nvfp4", "--gift.select=all"]),
        "fp32": ("llama3_debug_gift_fsdp2", [*CP, *start, *GIFT, *EXACT_FP32]),
        "off": ("llama3_debug_nogift_fsdp2", [*CP, *start]),
        "graph": ("llama3_debug_gift_graph", [*CP, *start, *GIFT, "--gift.format=nvfp4", "--gift.select=all"]),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)
    # the same sequences without CP: the same 2-rank batch mesh, each rank holding whole sequences
    no_cp = shared_runs({"no_cp_off": ("llama3_debug_nogift_fsdp2", [*CP[1:], *start])},
                        lambda name: str(tmp_path_factory.mktemp(name)), nproc=2)
    return lambda name: no_cp(name) if name == "no_cp_off" else get(name)


def _assert_gift_ran_under_cp(run: RunResult) -> None:
    assert REFUSAL not in run.output
    assert "Applied Context Parallel" in run.output  # torchtitan's CP wrapping of the attention
    assert not run.gift_warnings()
    # all 4 ranks manage the 20 linear weights, each with its share of the 4-rank fsdp group
    assert len(re.findall(r"GIFT: 20 weights managed", run.output)) == 4


def test_fsdp2_cp_quantizes_at_nvfp4_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("nvfp4"), runs("off")
    _assert_gift_ran_under_cp(gift)
    # the refreshes (after steps 2 and 4) put every layer on the transformed path (rank 0 logs each refresh;
    # the ranks' plans are compared after every refresh, so a rank that differed would have raised)
    assert len(re.findall(r"GIFT refresh at step [24]: 20 of 20 managed layers mapped", gift.output)) == 2
    # the whole model's fp32 gradient: embedding and head [4096, 128], per block wqkv/w1/w3 [384, 128],
    # w2 [128, 384] and wo [128, 128], 9 norms of 128
    full = 2 * 4096 * 128 + 4 * (4 * 384 * 128 + 128 * 128) + 9 * 128
    for r in logged_steps(gift, STEPS):
        assert r["gift/baseline_bytes_per_step"] == 4 * full, r
        # bytes handed to GIFT's reduce-scatters (counted at run time) == the plans' accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/collectives_per_step"] == 6, r
        assert r["gift/total_compression"] > 1.5, r
    assert gift.last("gift/refresh_step") == 4
    # the round trip at nvfp4 measured at the refresh, Euclidean and in the maps' coordinates
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert 0.03 < gift.last("gift/err_transformed_mean") < 0.3
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_cp_on_cpu_trains_like_the_same_sequences_without_cp(runs: Callable[[str], RunResult]) -> None:
    """CP changes the layout only: from one checkpoint, the CP run's losses are those of 2 ranks
    holding the whole sequences, up to fp32 summation order (the ring attention's merged softmax,
    4-rank instead of 2-rank gradient reductions)."""
    cp, whole = runs("off").losses(), runs("no_cp_off").losses()
    applied = "Applied Context Parallel"
    assert applied in runs("off").output and applied not in runs("no_cp_off").output
    assert cp.keys() == whole.keys() == set(range(1, STEPS + 1))
    for step in cp:
        assert abs(cp[step] - whole[step]) < 2e-5, (step, cp, whole)
    assert abs(runs("nvfp4").losses()[STEPS] - whole[STEPS]) < TOLERANCE


def test_fsdp2_cp_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_gift_ran_under_cp(exact)
    for r in logged_steps(exact, STEPS):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()


def test_graph_cp_rewrites_the_fsdp_reduce_scatters_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    """graph_trainer under CP: SimpleFSDP's traced reduce-scatters over the dp_shard x cp mesh
    are the ones the pass rewrites; CP's ring attention collectives stay in the traced step."""
    gift, off = runs("graph"), runs("off")
    _assert_gift_ran_under_cp(gift)
    found = re.findall(r"GIFT rewrite: 4 reduce-scatters \(4 buckets\) carrying 20 managed weights, 0 fallbacks; "
                       r"collective launches per step (\d+) -> (\d+); bytes per step of the rewritten collectives "
                       r"(\d+) -> (\d+)", gift.output)
    assert found, gift.output[-3000:]
    blocks = 4 * (4 * 384 * 128 + 128 * 128) + 8 * 128  # the four block buckets' fp32 gradients, norms included
    for before, after, base, wire in (map(int, f) for f in found):
        assert before == after and base == 4 * blocks and wire < base / 5
    for r in logged_steps(gift, STEPS):
        assert (r["gift/wire_bytes_per_step"], r["gift/baseline_bytes_per_step"]) == (wire, base), r
        assert r["gift/collectives_per_step"] == 4, r
    assert len(re.findall(r"GIFT refresh at step [24]: 20 of 20 managed layers mapped", gift.output)) == 2
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1] and any(g[s] != o[s] for s in g if s > 1)
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


@pytest.mark.parametrize("trainer,dims,mesh", [
    ("fsdp2", {"dp_shard": 2}, "fsdp"), ("fsdp2", {}, "fsdp"), ("graph", {"dp_shard": 2}, "fsdp"),
    ("fsdp2", {"tp": 2}, "fsdp"), ("graph", {"tp": 2}, "fsdp"), ("fsdp2", {"pp": 2}, "fsdp"),
    ("fsdp2", {"dp_replicate": 2}, "loss"), ("graph", {"dp_replicate": 2}, "loss"),
    ("fsdp2", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "loss"),
])
def test_cp_state_group_spans_the_cp_ranks(trainer: str, dims: dict[str, int], mesh: str) -> None:
    """GIFT's group under CP is torchtitan's ``fsdp`` mesh (dp_shard x cp), the one FSDP2 and
    SimpleFSDP reduce-scatter over, also with TP (per TP block) and PP (per stage); CP alone
    (dp_shard 1) still has 2 ranks there, so it is not refused as a one-rank FSDP2 layout (nor
    HSDP x CP with dp_shard 1 as DDP on graph_trainer: SimpleFSDP shards over the CP ranks).
    With HSDP it is torchtitan's ``loss`` mesh, dp_replicate x dp_shard x cp (the ``batch``
    mesh leaves the CP ranks out). The CP layouts' runs: tests/test_torchtitan_cp_layouts.py."""
    parallel_dims = SimpleNamespace(**{"tp": 1, "cp": 2, "pp": 1, "ep": 1, "dp_replicate": 1, "dp_shard": 1, **dims},
                                    get_mesh=lambda name: SimpleNamespace(get_group=lambda: name))
    assert data_parallel_group(parallel_dims, trainer) == mesh


def _ring_attention(rank: int, world: int) -> dict[str, float]:
    """Causal SDPA on q/k/v sharded on the sequence (head-tail slices, as torchtitan's CP hands
    them over) against the same SDPA on whole sequences: outputs and the three gradients."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._attention import (
        _enable_context_parallel_dispatcher,
        _HeadTailLoadBalancer,
    )

    from gift_compile.torchtitan_ext.cpu import cpu_compat

    cpu_compat.activate()
    _enable_context_parallel_dispatcher()  # what torchtitan's apply_cp_to_forward calls
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))  # [batch, heads, sequence, head_dim]
    mine = _HeadTailLoadBalancer(16, world, "cpu")._generate_indices().reshape(-1).chunk(world)[rank]
    local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local), is_causal=True).to_local()
    out.pow(2).sum().backward()
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    ref.pow(2).sum().backward()
    errors = {"out": (out - ref[:, :, mine]).abs().max()}
    errors |= {f"d{name}": (a.grad - b.grad[:, :, mine]).abs().max() for name, a, b in zip("qkv", local, whole)}
    return {name: float(e) for name, e in errors.items()}


def test_cpu_ring_attention_equals_whole_sequence_attention() -> None:
    """Without `cpu_compat`'s ring attention this raises torch's "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered"; with it, each CP rank's outputs and gradients are the whole sequences' rows."""
    for errors in run_ranks(_ring_attention, 2):
        assert max(errors.values()) < 1e-5, errors
