"""Each TP rank's weight block is its own GIFT matrix (`gift_compile.frameworks.tensor_parallel`), checked
on 4 gloo ranks (a 2 x 2 mesh: data-parallel x TP) with torch's own colwise / rowwise TP.

The K-FAC input factor of a managed layer must come from the inputs this TP rank computes with
(the whole input of a colwise layer, this rank's feature slice for a rowwise one, so the map is
block-diagonal across TP ranks) averaged over the data-parallel group only. The expected
factors are computed from a dense replica of the model; a state reduced over all four ranks
(or one reading the DTensor's global input) would not reproduce them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from multirank import run_ranks

D, H, TOKENS = 16, 32, 24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H, bias=False), nn.ReLU(), nn.Linear(H, D, bias=False))


def _batch(dp_coord: int) -> torch.Tensor:
    return torch.randn(2, TOKENS // 2, D, generator=torch.Generator().manual_seed(100 + dp_coord))


def _tp_statistics(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gift_compile import GiftConfig
    from gift_compile.frameworks.routing import manage
    from gift_compile.frameworks.tensor_parallel import local_matrix_shape

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_coord, dp_coord = mesh.get_group("dp"), mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    model = parallelize_module(_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    config = GiftConfig(format="nvfp4", geometry="dense", select="all", min_numel=1)
    state = manage(model, config, dp_group, mode="stats", split_rows=True)
    model(_batch(dp_coord)).sum().backward()
    for layer in state.layers.values():
        layer.stats.consolidate(state.group)
    return {
        "refused": _refusals(mesh, dp_group),
        "tp": tp_coord,
        "dp": dp_coord,
        "shapes": {name: layer.shape for name, layer in state.layers.items()},
        "global_shape": local_matrix_shape(model[2].weight, None),
        "world_shape": local_matrix_shape(model[2].weight, dist.group.WORLD),
        "factors": {name: layer.stats.factor.clone() for name, layer in state.layers.items()},
    }


def _refusals(mesh, dp_group) -> list[str]:
    """What GIFT cannot map onto a TP rank's block raises, naming the placement."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from gift_compile.frameworks.tensor_parallel import local_input, local_matrix_shape

    out = []
    strided = DTensor.from_local(torch.zeros(4, D), mesh["tp"], [_StridedShard(0, split_factor=2)])
    pending = DTensor.from_local(torch.zeros(2, D), mesh["tp"], [Partial()])
    for call in (lambda: local_matrix_shape(strided, dp_group), lambda: local_input(pending)):
        try:
            call()
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_tp_statistics, 4)


def test_each_tp_rank_manages_its_own_block(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["shapes"] == {"0.weight": (H // 2, D), "2.weight": (D, H // 2)}  # colwise rows, rowwise columns
        # no group, or one spanning the TP ranks too: every mesh dimension is data-parallel
        assert r["global_shape"] == r["world_shape"] == (D, H)


def test_statistics_come_from_the_local_inputs_over_the_data_parallel_group_only(ranks: list[dict]) -> None:
    model = _model()
    inputs = [_batch(c).reshape(-1, D) for c in range(2)]
    hidden = [torch.relu(x @ model[0].weight.detach().t()) for x in inputs]
    tokens = sum(x.shape[0] for x in inputs)  # the data-parallel group's tokens (2 x TOKENS)
    full_input = sum(x.t() @ x for x in inputs) / tokens
    for r in ranks:
        cols = slice(r["tp"] * H // 2, (r["tp"] + 1) * H // 2)
        rowwise_input = sum(h[:, cols].t() @ h[:, cols] for h in hidden) / tokens
        # colwise: every TP rank sees the whole input; rowwise: its feature slice (block-diagonal map)
        torch.testing.assert_close(r["factors"]["0.weight"], full_input)
        torch.testing.assert_close(r["factors"]["2.weight"], rowwise_input)
    slices = {r["tp"]: r["factors"]["2.weight"] for r in ranks}
    assert not torch.allclose(slices[0], slices[1])  # the TP ranks' blocks are different matrices


def test_placements_without_a_block_are_refused_by_name(ranks: list[dict]) -> None:
    for r in ranks:
        strided, partial = r["refused"]
        assert "placed _StridedShard" in strided and "mesh dimension 'tp'" in strided
        assert "Partial (unreduced) activation" in partial
