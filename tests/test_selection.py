"""Optimizer-aware choice of the selection metric (`gift_compile.selection.select_metric_for`)
and its torchtitan form, `select_metric = "auto_by_optimizer"`, resolved from the optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gift_compile.config import GiftConfigError
from gift_compile.selection import leaf_optimizers, preconditions_matrices, select_metric_for
from conftest import require


class _Net(nn.Module):
    """Two hidden matrices (`layers.*`), an embedding-like table and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 128, bias=False), nn.Linear(128, 32, bias=False)])
        self.norm = nn.LayerNorm(32)


def _hidden(net: _Net) -> list[torch.Tensor]:
    return [layer.weight for layer in net.layers]


def _muon_adamw(net: _Net) -> list[torch.optim.Optimizer]:
    hidden = _hidden(net)
    rest = [p for p in net.parameters() if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]


class _Container:
    """Like torchtitan's OptimizersContainer: the real optimizers in an `optimizers` list."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def test_muon_on_the_managed_weights_means_whitened_adamw_means_euclidean() -> None:
    net = _Net()
    opts = _muon_adamw(net)
    assert select_metric_for(opts, _hidden(net)) == "whitened"
    assert select_metric_for(_Container(opts), _hidden(net)) == "whitened"
    # the AdamW half of the same pair steps only the embedding and the norm
    assert select_metric_for(opts, [net.tok_embeddings.weight]) == "euclidean"
    assert select_metric_for(torch.optim.AdamW(net.parameters()), _hidden(net)) == "euclidean"
    assert select_metric_for(torch.optim.SGD(net.parameters()), _hidden(net)) == "euclidean"


def test_majority_of_managed_elements_decides_and_subclasses_are_recognised() -> None:
    net = _Net()
    big, small = net.layers[0].weight, net.layers[1].weight  # same numel: 4096 each
    wide = nn.Linear(32, 512, bias=False).weight  # 16384 elements
    dist_muon = type("DistMuon", (torch.optim.SGD,), {})  # torchtitan's name, another base
    shampoo_like = type("MyPreconditioner", (type("DistributedShampoo", (torch.optim.SGD,), {}),), {})
    assert preconditions_matrices(dist_muon([big], lr=0.1))
    assert preconditions_matrices(shampoo_like([big], lr=0.1))  # through the base class name
    assert not preconditions_matrices(torch.optim.Adam([big]))
    mixed = [dist_muon([big, small], lr=0.1), torch.optim.AdamW([wide])]
    assert select_metric_for(mixed, [big, small, wide]) == "euclidean"  # 8192 vs 16384 elements
    assert select_metric_for(mixed, [big, small]) == "whitened"
    assert len(leaf_optimizers(_Container([mixed[0], _Container([mixed[1]])]))) == 2


def test_unstepped_weights_and_non_optimizers_are_errors() -> None:
    net = _Net()
    opts = _muon_adamw(net)
    stranger = nn.Linear(4, 4).weight
    with pytest.raises(ValueError, match="none of the 1 managed weights is in its parameter groups"):
        select_metric_for(opts, [stranger])
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        select_metric_for(object(), _hidden(net))


def test_torchtitan_section_resolves_auto_by_optimizer() -> None:
    require("torchtitan", "torchtitan extra not installed")
    from gift_compile.torchtitan_ext.hooks import resolve_select_metric
    from gift_compile.torchtitan_ext.section import AUTO_METRIC, GiftSection

    section = GiftSection(enable=True, min_numel=1024)
    assert section.select_metric == AUTO_METRIC
    with pytest.raises(ValueError, match="needs the optimizer to be resolved"):
        section.to_gift_config()
    net = _Net()
    assert resolve_select_metric(section, _Container(_muon_adamw(net)), net, world=2) == "whitened"
    assert resolve_select_metric(section, _Container([torch.optim.AdamW(net.parameters())]), net, world=2) == "euclidean"
    assert section.to_gift_config(select_metric="whitened").select_metric == "whitened"
    explicit = GiftSection(select_metric="euclidean")
    assert resolve_select_metric(explicit, _muon_adamw(net), net, world=2) is None
    with pytest.raises(ValueError, match="is explicit"):
        explicit.to_gift_config(select_metric="whitened")
    with pytest.raises(GiftConfigError, match="allowed: euclidean, whitened, auto_by_optimizer"):
        GiftSection(select_metric="plain")
