"""The convergence study's reduce-scatter path (`bench.convergence.ShardedTwin`), 2 gloo ranks.

The twin must (a) really send the managed gradients through GIFT's quantized reduce-scatter
(bytes counted by the collective below fp32, error at the format's level, everything else
exact) and (b) at fp32 give the plain all-reduce's gradients and, after the optimizer step
on the plain model, the same forward as the plain model: otherwise the paired difference
between the two paths would not isolate the communication.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import gift_compile
from bench.convergence import ShardedTwin, _allreduce_fp32, check_settings
from bench.settings import profile
from bench.tiny_llama import TinyLlama, TinyLlamaConfig, loss
from gift_compile.config import GiftConfig
from tests.multirank import run_ranks


def _tokens(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(10 + rank))
    return t[:, :-1], t[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _twin_body(rank: int, world: int) -> dict:
    cfg = TinyLlamaConfig.tiny()
    x, y = _tokens(rank, cfg.vocab_size)
    ref = TinyLlama(cfg, seed=0)
    loss(ref(x), y).backward()
    _allreduce_fp32(list(ref.parameters()), world)
    exact = {n: p.grad.clone() for n, p in ref.named_parameters()}

    out: dict = {}
    for name, config in (("fp32", None), ("int2", GiftConfig(format="int2", block_size=32, geometry="none"))):
        model = TinyLlama(cfg, seed=0)
        twin = ShardedTwin(model, rank, world)
        if config is not None:
            gift_compile.apply(twin.module, config, group=dist.group.WORLD, fuse=False)
        loss(twin.module(x), y).backward()
        twin.gather_grads()
        out[name] = {"errs": {n: _rel(p.grad, exact[n]) for n, p in model.named_parameters()}}
        if config is not None:
            st = gift_compile.state(twin.module)
            out[name]["managed"] = sorted(st.layers)
            out[name]["totals"] = st.comm_totals()
            gift_compile.remove(twin.module)
        else:  # an optimizer step on the plain model, pushed into the shards: same forward
            torch.optim.AdamW(model.parameters(), lr=1e-2).step()
            twin.push_params()
            with torch.no_grad():
                out[name]["forward_diff"] = float((twin.module(x) - model(x)).abs().max())
                out[name]["moved"] = float((model(x) - ref(x)).abs().max())
    return out


def test_reduce_scatter_twin_quantizes_once_and_is_exact_at_fp32() -> None:
    a, b = run_ranks(_twin_body, 2)
    assert a["int2"]["errs"] == b["int2"]["errs"]  # every rank holds the same gathered gradient
    fp32, int2 = a["fp32"], a["int2"]
    assert max(fp32["errs"].values()) < 1e-6, fp32["errs"]
    assert fp32["forward_diff"] == 0.0 and fp32["moved"] > 1e-3
    managed = int2["managed"]
    assert len(managed) == 14  # 7 linear weights x 2 blocks
    for n, err in int2["errs"].items():
        if n in managed:
            assert 0.1 < err < 1.0, (n, err)  # int2 with block scales: tens of percent, never exact
        else:
            assert err < 1e-6, (n, err)  # embeddings, norms, head: fp32 in the same collective
    totals = int2["totals"]
    assert totals["calls"] > 0 and 0 < totals["wire"] < totals["baseline"]


def test_reduce_scatter_path_refuses_what_it_cannot_run() -> None:
    import dataclasses

    s = profile("smoke").convergence
    with pytest.raises(ValueError, match="unknown convergence path"):
        check_settings(dataclasses.replace(s, path="ring"))
    with pytest.raises(ValueError, match="momentum"):
        check_settings(dataclasses.replace(s, path="reduce-scatter", arms=(("muon", ("fp32", "gift-nvfp4-mom-d2")),)))
    with pytest.raises(ValueError, match="eager"):
        check_settings(dataclasses.replace(s, path="reduce-scatter", compile=True))
    check_settings(dataclasses.replace(s, path="reduce-scatter"))
