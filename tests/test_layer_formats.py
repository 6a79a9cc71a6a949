"""Bits per layer (`GiftConfig.layer_formats`): each layer is sent, counted and measured at its
own format, and the bench's allocation keeps the budget."""

import pytest
import torch

import gift_compile
from bench.convergence.bit_allocation import allocate
from gift_compile.config import GiftConfig, GiftConfigError
from mlp import MLP as _MLP
from multirank import run_ranks


def test_first_matching_glob_wins_and_bad_entries_name_the_field():
    cfg = GiftConfig(format="int2", layer_formats="*.fc1.weight=int3, *fc*=ternary")
    assert cfg.layer_formats == ("*.fc1.weight=int3", "*fc*=ternary")
    assert cfg.format_for("m.fc1.weight") == "int3"
    assert cfg.format_for("m.fc2.weight") == "ternary"
    assert cfg.format_for("head.weight") == "int2"
    for bad in ("*=fp6", "no_equals", "=int3", ["a=int3", ""]):
        with pytest.raises(GiftConfigError, match=r"GiftConfig\.layer_formats=.*allowed"):
            GiftConfig(format="int2", layer_formats=bad)
    with pytest.raises(GiftConfigError, match="block_rotation"):
        GiftConfig(format="nvfp4", layer_formats="*=fp8_e4m3", block_rotation=True)


def _train(rank: int, world: int, layer_formats: str) -> dict:
    m = _MLP(96)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gift_compile.apply(m, GiftConfig(format="int2", geometry="none", min_numel=1024, select="all",
                                     layer_formats=layer_formats), optimizer=opt)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 96, generator=g), torch.randn(64, 4, generator=g)
    grads = {}
    for step in range(2):
        ((m(x) - y) ** 2).mean().backward()
        if step == 0:  # before the first update: both runs' parameters are still the same
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    st = gift_compile.state(m)
    return {"formats": {n: st.layer_plan(n).items[0].format for n in st.layers}, "wire": st.comm_totals()["wire"],
            "accounted": st.accounted_bytes_per_step(), "grads": grads}


def test_each_layer_is_sent_and_counted_at_its_own_format():
    uniform = run_ranks(_train, 2, "")
    mixed = run_ranks(_train, 2, "fc1.weight=int3")
    assert uniform[0]["formats"] == {"fc1.weight": "int2", "fc2.weight": "int2"}
    assert mixed[0]["formats"] == {"fc1.weight": "int3", "fc2.weight": "int2"}
    # counted at the collective: more bytes for fc1's wider codes, as the accounting says
    assert mixed[0]["accounted"] > uniform[0]["accounted"]
    assert mixed[0]["wire"] - uniform[0]["wire"] == 2 * (mixed[0]["accounted"] - uniform[0]["accounted"])
    # fc1's averaged gradient moved (3-bit codes), fc2's is the same bits; both ranks agree
    assert not torch.equal(mixed[0]["grads"]["fc1.weight"], uniform[0]["grads"]["fc1.weight"])
    assert torch.equal(mixed[0]["grads"]["fc2.weight"], uniform[0]["grads"]["fc2.weight"])
    assert all(torch.equal(mixed[0]["grads"][n], mixed[1]["grads"][n]) for n in mixed[0]["grads"])


def test_allocation_spends_the_budget_where_the_error_falls_most():
    errors = {"hard": {"t": 0.5, "i2": 0.35, "i3": 0.08}, "easy1": {"t": 0.22, "i2": 0.13, "i3": 0.05},
              "easy2": {"t": 0.22, "i2": 0.13, "i3": 0.05}}
    nbytes = {n: {"t": 1.6, "i2": 2.25, "i3": 3.25} for n in errors}
    choice = allocate(errors, nbytes, budget=3 * 2.25)
    assert choice["hard"] == "i3" and sum(nbytes[n][f] for n, f in choice.items()) <= 3 * 2.25
    assert sum(errors[n][f] for n, f in choice.items()) < 0.35 + 2 * 0.13  # below int2 on every layer
    with pytest.raises(ValueError, match="over the budget"):
        allocate(errors, nbytes, budget=1.0)


def test_hsdp_refuses_per_layer_formats_naming_the_replica_hop():
    from gift_compile.frameworks import hsdp

    class _State:
        config = GiftConfig(format="int2", layer_formats="fc1.weight=int3")

    with pytest.raises(ValueError, match="layer_formats=.*replica hop"):
        hsdp._attach(_State(), object())
