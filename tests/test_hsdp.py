"""HSDP on FSDP2 with a precision per hop, 4 gloo ranks (2 replicas x 2 shards): `fully_shard` on
the shard-only mesh, GIFT's reduce-scatter over the shard group at `format` and GIFT's all-reduce of
the reduced shard over the replica group at `replica_format` (`gift_compile.frameworks.hsdp`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from mlp import EXACT_OUTSIDE
from multirank import run_ranks

# (format, replica_format, geometry, error_feedback): each hop alone quantized, both, both exact,
# and error feedback (a residual on the shard hop, none on the replica hop)
CASES = [
    ("fp32", "fp32", "none", False),
    ("fp32", "int4", "none", False),
    ("fp8_e4m3", "fp32", "none", False),
    ("fp8_e4m3", "nvfp4", "hadamard", False),
    ("fp8_e4m3", "int4", "none", True),
]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.down = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def _sharded_pair(shard_mesh) -> tuple[nn.Module, nn.Module]:
    """A reference `_Net` and a copy of it under FSDP2 on `shard_mesh`: `up`, then `norm` and
    `down` together, then the root (seeded: every rank builds the same weights)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference, model = _Net(), _Net()
    model.load_state_dict(reference.state_dict())
    fully_shard(model.up, mesh=shard_mesh)
    fully_shard([model.norm, model.down], mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return reference, model


def _grad_error(model: nn.Module, reference: nn.Module, name: str, divisor: float) -> float:
    """Relative error of `model`'s gradient `name` against the all-reduced reference's, divided
    by `divisor`."""
    import torch.distributed as dist

    ref = dict(reference.named_parameters())[name].grad.clone()
    dist.all_reduce(ref)
    ref /= divisor
    got = dict(model.named_parameters())[name].grad.full_tensor()
    return float((got - ref).norm() / ref.norm())


def _step_identical_on_replicas(model: nn.Module, opt: torch.optim.Optimizer, replica_group) -> bool:
    """Step `opt` and whether both replicas held bit-identical gradient shards before the step and
    parameter shards after it."""
    import torch.distributed as dist

    local = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    others: list = [None] * 2
    dist.all_gather_object(others, (local, params), group=replica_group)
    return all(torch.equal(a[k], b[k]) for a, b in zip(others[0], others[1]) for k in a)


def _hsdp_worker(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.api import manage
    from gift_compile.config import GiftConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica_group = mesh.get_group("replicate")
    out = []
    for fmt, replica_fmt, geometry, error_feedback in CASES:
        # two modules in one FSDP group (as torchtitan shards [norm, output]): one bucket per hop
        reference, model = _sharded_pair(mesh["shard"])
        config = GiftConfig(**EXACT_OUTSIDE, format=fmt, replica_format=replica_fmt, geometry=geometry, select="all",
                            min_numel=1024, exclude=(), reduce_op="sum", error_feedback=error_feedback)
        state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
        fsdp2.install(model, state, compiled=False)
        hop = hsdp.install(model, state, replica_group, compiled=False)
        hop.measure_every = 1
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + rank))
        model(x).square().sum().backward()
        # exact reference: every rank's full gradient, summed over all 4 ranks in fp32, then averaged
        reference(x).square().sum().backward()
        errs = {}
        for name in ("up.weight", "down.weight", "norm.weight"):
            ref = dict(reference.named_parameters())[name].grad.clone()
            dist.all_reduce(ref)
            ref /= world
            got = dict(model.named_parameters())[name].grad.full_tensor()
            errs[name] = float((got - ref).norm() / ref.norm())
        probe = hop.take_error()
        totals = hsdp.hop_totals(state)
        accounted = hsdp.accounted_bytes(model)
        state.check_health()
        identical = _step_identical_on_replicas(model, opt, replica_group)
        residual_moved = error_feedback and all(bool(l.residual[0].abs().sum() > 0) for l in state.layers.values())
        out.append({"case": (fmt, replica_fmt, geometry), "residual_moved": residual_moved, "errs": errs, "totals": totals, "accounted": accounted,
                    "identical": identical, "replica_world": hop.world, "probe": probe})
    return out, _refusals(rank, mesh, replica_group)


def _refusals(rank: int, mesh, replica_group) -> list[str]:
    """What `hsdp.install` refuses: a native 2-D HSDP mesh (FSDP2 would all-reduce at fp32 before
    the hook), and replicas that do not start identical."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.api import manage
    from gift_compile.config import GiftConfig

    errors = []
    config = GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", geometry="none", min_numel=1024, exclude=(), reduce_op="sum")
    for native, seed in ((True, 0), (False, rank // 2)):  # replica rank differs: rank // 2 seeds differ
        torch.manual_seed(seed)
        model = _Net()
        fully_shard(model, mesh=mesh if native else mesh["shard"])
        state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
        fsdp2.install(model, state, compiled=False)
        try:
            hsdp.install(model, state, replica_group, compiled=False)
            errors.append("")
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    return errors


def test_hsdp_each_hop_at_its_format_counts_bytes_and_keeps_replicas_identical():
    results = run_ranks(_hsdp_worker, 4)
    for _, (native, drifted) in results:
        assert "2-D (native HSDP) mesh" in native, native
        assert "replicas must start bit-identical" in drifted, drifted
    for rank_results, _ in results:
        by_case = {r["case"]: r for r in rank_results}
        for r in rank_results:
            assert r["identical"], f"{r['case']}: replicas differ"
            assert r["replica_world"] == 2
            for hop in ("shard", "replica"):
                assert r["totals"][hop]["wire"] == r["accounted"][hop], (r["case"], hop, r["totals"], r["accounted"])
                assert r["totals"][hop]["calls"] == 2  # one per FSDP parameter group
            # unmanaged parameters (the norm) travel at fp32 on both hops
            assert r["errs"]["norm.weight"] < 1e-6, r
        with_ef = by_case[("fp8_e4m3", "int4", "none")]
        assert with_ef["residual_moved"] and 0.02 < with_ef["errs"]["up.weight"] < 0.3, with_ef
        exact = by_case[("fp32", "fp32", "none")]
        replica_int4 = by_case[("fp32", "int4", "none")]
        shard_fp8 = by_case[("fp8_e4m3", "fp32", "none")]
        both = by_case[("fp8_e4m3", "nvfp4", "hadamard")]
        # the run-time probe of the replica hop: 0 at fp32, the measured int4 error when only that hop
        # is quantized (the probe pools both weights, so it lies between their errors)
        assert exact["probe"] == 0.0 and shard_fp8["probe"] == 0.0
        lo, hi = sorted(replica_int4["errs"][w] for w in ("up.weight", "down.weight"))
        assert 0.9 * lo < replica_int4["probe"] < 1.1 * hi, replica_int4
        assert both["probe"] > 0.02
        for w in ("up.weight", "down.weight"):
            assert exact["errs"][w] < 1e-6
            # each quantized hop's error is at its format's level; an fp32 hop adds none
            assert 0.02 < replica_int4["errs"][w] < 0.3, replica_int4
            assert 1e-3 < shard_fp8["errs"][w] < 0.06, shard_fp8
            assert shard_fp8["errs"][w] < replica_int4["errs"][w]
            assert 0.02 < both["errs"][w] < 0.4, both
        # an fp32 hop sends its baseline's bytes plus headers; a low-bit hop far fewer
        assert replica_int4["totals"]["replica"]["wire"] * 4 < replica_int4["totals"]["replica"]["baseline"] * 1.5
        assert shard_fp8["totals"]["shard"]["wire"] < shard_fp8["totals"]["shard"]["baseline"]
        assert exact["totals"]["replica"]["wire"] > exact["totals"]["replica"]["baseline"]


def _one_shard_worker(rank: int, world: int) -> dict:
    """2 replicas x 1 shard: FSDP2 never calls the custom reduce-scatter, so GIFT's replica hop is
    the only collective; one backward, then a refresh that measures every layer's probe."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.api import manage
    from gift_compile.config import GiftConfig

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    replica_group = mesh.get_group("replicate")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + rank))

    def build(config: GiftConfig | None, factor: float | None = None) -> tuple[nn.Module, nn.Module]:
        reference, model = _sharded_pair(mesh["shard"])
        if factor is not None:
            for m in (model, model.up, model.norm):
                m.set_gradient_divide_factor(factor)
        return reference, model

    # the premise of the refused explicit factor: FSDP2 at one shard, with the SUM reductions
    # GIFT's install forces, divides by it twice (no GIFT here: FSDP2's own one-rank copy)
    reference, plain = build(None, factor=2.0)
    for m in (plain, plain.up, plain.norm):
        m.set_force_sum_reduction_for_comms(True)
    plain(x).square().sum().backward()
    reference(x).square().sum().backward()
    local_ref = reference.up.weight.grad
    twice = float((plain.up.weight.grad.full_tensor() - local_ref / 4).norm() / local_ref.norm())

    config = GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", geometry="lowrank", select="auto", refresh_every=1, min_numel=1024,
                        exclude=(), error_feedback=True)
    reference, model = build(None)
    state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
    fsdp2.install(model, state, compiled=False)
    hop = hsdp.install(model, state, replica_group, compiled=False)
    hop.measure_every = 1
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    errs = {n: _grad_error(model, reference, n, 2.0) for n in ("up.weight", "down.weight", "norm.weight")}
    probes = {n: float(l.probe.norm()) for n, l in state.layers.items()}
    residuals = {n: float(l.residual[0].abs().sum()) for n, l in state.layers.items()}
    totals, accounted, probe_err = hsdp.hop_totals(state), hsdp.accounted_bytes(model), hop.take_error()
    state.check_health()
    record = state.refresh()
    decided = {n: l.decided for n, l in state.layers.items()}

    refusals = []
    for kwargs, factor in (({"replica_format": "int4"}, None), ({}, 2.0)):
        _, other = build(None, factor)
        other_state = manage(other, GiftConfig(**EXACT_OUTSIDE, geometry="lowrank", min_numel=1024, exclude=(), **kwargs),
                             dist.group.WORLD, mode="stats", split_rows=True)
        fsdp2.install(other, other_state, compiled=False)
        try:
            hsdp.install(other, other_state, replica_group, compiled=False)
            refusals.append("")
        except ValueError as e:
            refusals.append(str(e))
    import gift_compile

    _, alone = build(None)
    try:
        gift_compile.apply(alone, GiftConfig(**EXACT_OUTSIDE, min_numel=1024, exclude=()))
        refusals.append("")
    except ValueError as e:
        refusals.append(str(e))
    return {"twice": twice, "errs": errs, "probes": probes, "residuals": residuals, "totals": totals,
            "accounted": accounted, "probe_err": probe_err, "record": record.layers, "decided": decided,
            "refusals": refusals}


def test_hsdp_with_one_shard_runs_the_replica_hop_as_the_only_collective():
    """Before: the probes stayed zero (every refresh measurement NaN, every layer silently
    dropped), error feedback never ran and FSDP2 divided the gradient by 4 instead of 2."""
    for r in run_ranks(_one_shard_worker, 2):
        assert r["twice"] < 1e-6, r["twice"]
        # the mean over 2 replicas, quantized once at fp8 (the norm travels at fp32)
        assert r["errs"]["norm.weight"] < 1e-6, r["errs"]
        for w in ("up.weight", "down.weight"):
            assert 1e-3 < r["errs"][w] < 0.06, r["errs"]
            assert r["probes"][w] > 0 and r["residuals"][w] > 0, r
        assert 1e-3 < r["probe_err"] < 0.06, r["probe_err"]
        # nothing crosses the one-rank shard group; the replica hop counted what it handed over
        assert r["totals"]["shard"]["wire"] == r["totals"]["shard"]["calls"] == r["accounted"]["shard"] == 0
        assert r["totals"]["replica"]["wire"] == r["accounted"]["replica"] > 0
        assert r["totals"]["replica"]["calls"] == 2
        assert r["totals"]["replica"]["wire"] < r["totals"]["replica"]["baseline"]
        for name, row in r["record"].items():
            assert 0 < row["err_euclidean"] < 0.1 and 0 < row["err_transformed"] < 0.1, (name, row)
        assert all(r["decided"].values()), r["decided"]  # measured, so the gain rule decided every layer
        replica_format, factor, apply = r["refusals"]
        assert "reduce-scatters over a one-rank group" in apply, apply
        assert "there is no shard hop" in replica_format and "replica_format='int4'" in replica_format
        assert "by factor squared" in factor



def _two_nodes_worker(rank: int, world: int) -> dict:
    """HSDP as torchrun starts it on 2 nodes x 2 ranks (`LOCAL_WORLD_SIZE=2`), the state over all 4
    ranks (two levels: 2 nodes x 2) with the int2 recipe's error feedback, two steps on each mesh:
    2 replicas x 2 shards (the shard group inside one node, the replica group one rank per node: each
    hop one level) and 4 replicas x 1 shard (the replica hop, one level, carries the residual)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gift_compile.api import manage
    from gift_compile.config import GiftConfig
    from gift_compile.frameworks import fsdp2, hsdp

    # what torchrun sets on 2 nodes x 2 ranks, before GIFT reads the node layout
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    out = {}
    for replicas in (2, 4):
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        replica_group = mesh.get_group("replicate")
        reference, model = _sharded_pair(mesh["shard"])
        # muon-int2-leaky-ef's codec and residual (no map: its geometry "auto" asks for Muon); the
        # gradients outside the layers at their default formats (the norm at bf16)
        config = GiftConfig(format="int2", block_size=32, error_feedback=True, error_feedback_decay=0.9,
                            block_rotation=True, geometry="none", select="all", min_numel=1024, exclude=(),
                            reduce_op="sum" if replicas == 2 else "avg")
        state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
        fsdp2.install(model, state, compiled=False)
        hsdp.install(model, state, replica_group, compiled=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).square().sum().backward()
            if step == 0:  # against the fp32 all-reduce of every rank's full gradient (the mean)
                reference(x).square().sum().backward()
                errs = {name: _grad_error(model, reference, name, world)
                        for name in ("up.weight", "down.weight", "norm.weight")}
            state.check_health()
            opt.step()
            opt.zero_grad()
        params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        others: list = [None] * replicas
        dist.all_gather_object(others, params, group=replica_group)
        out[replicas] = {"two_level": state.layout.two_level, "errs": errs,
                         "identical": all(torch.equal(o[k], params[k]) for o in others for k in params),
                         "residual_moved": all(bool(l.residual[0].abs().sum() > 0) for l in state.layers.values())}
    return out


def test_hsdp_on_two_nodes_with_error_feedback_sizes_each_hop_by_its_own_layout():
    """Before: under LOCAL_WORLD_SIZE=2 the state over all 4 ranks sized each layer's residual
    for a node's chunk of its two-level layout (`down`: 32 rows) while the hop that carries it,
    one level, sends the whole gradient (64 rows): the first backward raised; and the shard
    hop's items outside the layers were planned for 4 ranks, not the shard group's 2."""
    for r in run_ranks(_two_nodes_worker, 4):
        for replicas, case in r.items():
            assert case["two_level"], case  # the premise: the state's own group spans 2 nodes x 2 ranks
            assert case["identical"], f"{replicas} replicas differ"
            assert case["residual_moved"], case
            # the managed weights went at int2 (really quantized), the norm at bf16: the mean, at its level
            for name in ("up.weight", "down.weight"):
                assert 0.05 < case["errs"][name] < 0.8, (replicas, name, case["errs"])
            assert case["errs"]["norm.weight"] < 0.01, (replicas, case["errs"])


def _native_shard_hop_worker(rank: int, world: int) -> dict:
    """2 replicas x 2 shards under `shard_hop="native"` and, for comparison, "gift" (both hops at
    fp8), one backward each and a refresh; the same at fp32 (exact); and FSDP2 without the replica
    hop under "native" (refused at the backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.api import manage
    from gift_compile.config import GiftConfig

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica_group = mesh.get_group("replicate")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + rank))
    out: dict = {}
    for hop_kind, fmt in (("native", "fp8_e4m3"), ("gift", "fp8_e4m3"), ("native", "fp32")):
        reference, model = _sharded_pair(mesh["shard"])
        config = GiftConfig(**EXACT_OUTSIDE, format=fmt, shard_hop=hop_kind, geometry="lowrank", select="auto",
                            refresh_every=1, min_numel=1024, exclude=(), error_feedback=fmt != "fp32")
        state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
        fsdp2.install(model, state, compiled=False)
        hsdp.install(model, state, replica_group, compiled=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        errs = {n: _grad_error(model, reference, n, world) for n in ("up.weight", "down.weight", "norm.weight")}
        totals, accounted = hsdp.hop_totals(state), hsdp.accounted_bytes(model)
        state.check_health()
        layers = {n: {"residual": None if l.residual is None else (tuple(l.residual[0].shape),
                                                                   float(l.residual[0].abs().sum())),
                      "probe": (tuple(l.probe.shape), float(l.probe.norm()))} for n, l in state.layers.items()}
        state.refresh()
        decided = all(l.decided for l in state.layers.values())
        identical = _step_identical_on_replicas(model, opt, replica_group)
        out[hop_kind, fmt] = {"errs": errs, "totals": totals, "accounted": accounted, "layers": layers,
                              "decided": decided, "identical": identical}
    _, alone = _sharded_pair(mesh["shard"])
    state = manage(alone, GiftConfig(**EXACT_OUTSIDE, shard_hop="native", geometry="none", min_numel=1024, exclude=()),
                   dist.group.WORLD, mode="stats", split_rows=True)
    fsdp2.install(alone, state, compiled=False)
    try:
        alone(x).square().sum().backward()
        out["refused"] = ""
    except RuntimeError as e:
        out["refused"] = str(e)
    return out


def test_native_shard_hop_codes_each_rows_shard_once_on_the_replica_hop():
    """`shard_hop="native"`: the shard hop is FSDP2's own reduce-scatter (raw: its counted wire is
    its baseline and the accounting's), the replica hop carries the layers' plans on each rank's
    rows (residual and probe of the shard's rows, written; a refresh decides on them) and is the
    only rounding, so the gradient's error is below the two-rounding "gift" hop's at the same
    format; at fp32 it is exact; replicas stay identical; without the replica hop it refuses."""
    for r in run_ranks(_native_shard_hop_worker, 4):
        assert "no replica hop is installed" in r["refused"], r["refused"]
        native, gift, exact = r["native", "fp8_e4m3"], r["gift", "fp8_e4m3"], r["native", "fp32"]
        for run in (native, gift, exact):
            assert run["identical"] and run["decided"], run
            for hop in ("shard", "replica"):
                assert run["totals"][hop]["wire"] == run["accounted"][hop] > 0, (hop, run["totals"], run["accounted"])
                assert run["totals"][hop]["calls"] == 2  # one per FSDP parameter group
            assert run["errs"]["norm.weight"] < 1e-6, run["errs"]
        for run in (native, exact):  # the shard hop raw
            assert run["totals"]["shard"]["wire"] == run["totals"]["shard"]["baseline"], run["totals"]
        assert native["totals"]["replica"]["wire"] < 0.5 * native["totals"]["replica"]["baseline"], native["totals"]
        for w, rows in (("up.weight", 64), ("down.weight", 32)):  # each rank's rows of [128, 64] and [64, 128]
            assert exact["errs"][w] < 1e-6, exact["errs"]
            assert 1e-3 < native["errs"][w] < gift["errs"][w] < 0.06, (w, native["errs"], gift["errs"])
            residual_shape, moved = native["layers"][w]["residual"]
            assert residual_shape[0] == rows and moved > 0, native["layers"][w]
            probe_shape, norm = native["layers"][w]["probe"]
            assert probe_shape[0] == rows and norm > 0, native["layers"][w]
            assert gift["layers"][w]["residual"][0][0] == 2 * rows  # the shard hop's: the whole local gradient
