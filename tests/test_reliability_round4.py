"""Reliability round 4 on 2-4 gloo ranks (issue 56, and issue 57's node-layout mismatches):
each case is correct or raises the same error on every rank, none hangs.

- the node layout is agreed over the parent group before any subgroup exists: ranks that
  disagree (`ranks_per_node`, `LOCAL_WORLD_SIZE`) or sit on nodes of unequal size raise the same
  `TopologyError` on every rank; a setting the launcher contradicts is warned about on every rank;
  a process group destroyed and re-created gets a fresh layout;

Every multi-rank case runs under a timeout far below gloo's (30 min), so a hang fails the test
in seconds, and asserts what every rank saw.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from multirank import run_ranks
from mlp import MLP

FAST = 90  # seconds: far under gloo's timeout, so a hang fails quickly
CFG = dict(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8, refresh_every=2, select="all", exclude=())


def _gift_log() -> list[str]:
    """The messages gift_compile logs from now on in this (rank) process, as a list that grows."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gift_compile").addHandler(handler)
    return records


def _train_step(net: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> dict[str, torch.Tensor]:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
    net(x).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad()
    return grads


# ---- class 1, 2 and issue 57 item 3: the node layout agreed before it is used ----------------------


def _layout_body(rank: int, world: int, settings: list, env: list[dict[str, str]]) -> dict:
    """`apply` and one backward with this rank's `ranks_per_node` and launcher variables."""
    os.environ.update(env[rank])
    log = _gift_log()
    out: dict = {}
    try:
        model = MLP(64)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gift_compile.apply(model, GiftConfig(**CFG, ranks_per_node=settings[rank]), optimizer=opt, fuse=False)
        _train_step(model, opt, rank, 0)
        out["result"] = "stepped"
        out["layout"] = gift_compile.state(model).layout
    except Exception as e:  # what every rank raised, to be compared
        out["result"] = f"{type(e).__name__}: {e}"
    out["warnings"] = [m for m in log if "LOCAL_WORLD_SIZE" in m]
    return out


@pytest.mark.parametrize("case", ["settings 2/2/4/4", "LOCAL_WORLD_SIZE 2/2/4/4", "LOCAL_WORLD_SIZE 1/3/3/3"])
def test_ranks_that_disagree_on_the_node_layout_raise_the_same_error_on_every_rank(case):
    """Before: ranks waited in their node group's `new_group` until gloo's timeout (2/2/4/4), or
    ranks 1-3 raised about a layout that did not exist while rank 0 went on (1 + 3). After: one
    collective over the parent group, then the same `TopologyError` on every rank."""
    if case == "settings 2/2/4/4":
        settings, env = [2, 2, 4, 4], [{}] * 4
    elif case == "LOCAL_WORLD_SIZE 2/2/4/4":
        settings, env = [None] * 4, [{"LOCAL_WORLD_SIZE": v} for v in "2244"]
    else:  # what torchrun sets on two nodes of 1 and 3 processes
        settings = [None] * 4
        env = [{"LOCAL_WORLD_SIZE": lws, "GROUP_RANK": node, "LOCAL_RANK": local}
               for lws, node, local in (("1", "0", "0"), ("3", "1", "0"), ("3", "1", "1"), ("3", "1", "2"))]
    results = run_ranks(_layout_body, 4, settings, env, timeout=FAST)
    errors = [r["result"] for r in results]
    assert all(e.startswith("TopologyError") for e in errors), errors
    assert len(set(errors)) == 1, errors  # the same message on every rank
    if case.startswith("settings"):
        assert "disagree on GiftConfig.ranks_per_node" in errors[0] and "rank 2: ranks_per_node=4" in errors[0]
    elif "2/2/4/4" in case:
        assert "different node sizes" in errors[0] and "LOCAL_WORLD_SIZE='4'" in errors[0]
    else:
        assert "unevenly" in errors[0] and "{0: 1, 1: 3}" in errors[0] and "GROUP_RANK" in errors[0]


def test_a_setting_the_launcher_contradicts_is_warned_about_on_every_rank():
    """Issue 57: `ranks_per_node=4` under LOCAL_WORLD_SIZE=2 was taken silently. The setting is
    followed (a simulated layout is legitimate) with a warning on every rank saying why it matters."""
    results = run_ranks(_layout_body, 4, [4] * 4, [{"LOCAL_WORLD_SIZE": "2"}] * 4, timeout=FAST)
    for r in results:
        assert r["result"] == "stepped", r["result"]
        assert len(r["warnings"]) == 1 and "ranks_per_node=4" in r["warnings"][0], r["warnings"]
        assert "spans several machines" in r["warnings"][0]
    results = run_ranks(_layout_body, 4, [2] * 4, [{"LOCAL_WORLD_SIZE": "4"}] * 4, timeout=FAST)
    for r in results:
        assert r["result"] == "stepped" and r["layout"].two_level, r["result"]
        assert len(r["warnings"]) == 1 and "splits a machine" in r["warnings"][0], r["warnings"]


def _recreated_body(rank: int, world: int, tmp: str) -> list[str]:
    """Train, destroy the process group, make a new one, apply afresh and train again."""
    out = []
    for round_ in range(2):
        if round_:
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store2"), world), rank=rank,
                                    world_size=world)
        model = MLP(64)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gift_compile.apply(model, GiftConfig(**CFG, ranks_per_node=2), optimizer=opt, fuse=False)
        try:
            _train_step(model, opt, rank, 0)
            out.append("stepped" if gift_compile.state(model).layout.two_level else "one level")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_recreated_process_group_gets_a_fresh_layout():
    """Before: the process-wide layout cache kept the destroyed group's subgroups, so the new
    group's first backward failed on every rank ("Could not resolve the process group")."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_recreated_body, 4, tmp, timeout=FAST)
    assert results == [["stepped", "stepped"]] * 4, results


_TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist, gift_compile
    from gift_compile.config import GiftConfig
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    try:
        gift_compile.apply(model, GiftConfig(format="fp8_e4m3", min_numel=1024))
        model(torch.randn(4, 64)).sum().backward()
        print("RESULT rank", dist.get_rank(), "stepped", flush=True)
    except Exception as e:
        print("RESULT rank", dist.get_rank(), type(e).__name__, str(e).replace(chr(10), " "), flush=True)
    dist.destroy_process_group()
""")


def test_two_torchrun_nodes_of_unequal_size_raise_the_same_error_on_every_rank(tmp_path):
    """Two torchrun "nodes" on this machine, of 2 and 1 processes (issue 57: ranks 0-1 raised a
    `TopologyError`, rank 2 a bare "Connection closed by peer"): every rank raises the same error."""
    script = tmp_path / "uneven.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                  str(k), "--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port",
                                  str(port), str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for k, n in ((0, 2), (1, 1))]
    outputs = []
    for p in launches:
        try:
            outputs.append(p.communicate(timeout=FAST)[0])
        except subprocess.TimeoutExpired:
            for q in launches:
                q.kill()
            raise
    lines = sorted(line for text in outputs for line in text.splitlines() if line.startswith("RESULT"))
    assert len(lines) == 3, outputs
    messages = {line.split(" ", 3)[3] for line in lines}
    assert len(messages) == 1, lines  # the same error on every rank
    message = messages.pop()
    assert message.startswith("TopologyError") and "{0: 2, 1: 1}" in message, message


# ---- class 5: no silent overflow -------------------------------------------------------------------


class _Huge(nn.Module):
    """One managed linear whose weight gradient is 1e38 in every element on every rank (a batch
    of one all-ones row, the output's gradient 1e38): the mean is finite, the sum over 4 ranks not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 128, bias=False)

    def forward(self) -> torch.Tensor:
        return (self.fc(torch.ones(1, 64)) * 1e38).sum()


def _overflow_body(rank: int, world: int) -> dict:
    out = {}
    for fmt in ("fp32", "fp8_e4m3"):
        for per_node in (0, 2):
            for path in ("plain", "ddp"):
                model = _Huge()
                net = nn.parallel.DistributedDataParallel(model) if path == "ddp" else model
                cfg = GiftConfig(format=fmt, geometry="none", min_numel=1024, exclude=(), ranks_per_node=per_node)
                gift_compile.apply(net, cfg, fuse=False)
                try:
                    net().backward()
                    assert gift_compile.state(net).comm_totals()["calls"] > 0  # GIFT carried it
                    out[fmt, per_node, path] = model.fc.weight.grad.clone()
                except Exception as e:
                    out[fmt, per_node, path] = f"{type(e).__name__}: {e}"
    return out


def test_a_finite_mean_of_huge_gradients_is_returned_not_an_overflowed_sum():
    """Before: every rank's gradient at 1e38 came back inf (fp32) or NaN (fp8) with no error,
    flat and two-level alike (GIFT summed, then averaged). After: 1e38, as native DDP returns."""
    results = run_ranks(_overflow_body, 4, timeout=FAST)
    want = torch.full((128, 64), 1e38)
    for r in results:
        for (fmt, per_node, path), got in r.items():
            assert isinstance(got, torch.Tensor), (fmt, per_node, path, got)
            assert torch.isfinite(got).all(), (fmt, per_node, path)
            if fmt == "fp32":
                assert torch.equal(got, want), (fmt, per_node, path, got.flatten()[:4])
            else:
                torch.testing.assert_close(got, want, rtol=0.07, atol=0), (fmt, per_node, path)


# ---- class 6: optimizers -----------------------------------------------------------------------------


def _reattach_body(rank: int, world: int) -> dict:
    import gc
    import weakref

    model = MLP(64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gift_compile.apply(model, GiftConfig(**CFG), optimizer=opt, fuse=False)
    for i in range(2):
        _train_step(model, opt, rank, i)
    st = gift_compile.state(model)
    out = {"steps_before": st.steps, "refreshes_before": len(st.history)}
    old = weakref.ref(opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # re-created, as after a restart
    gc.collect()
    gift_compile.apply(model, GiftConfig(**CFG), optimizer=opt, fuse=False)
    gc.collect()
    out["old_released"] = old() is None
    for i in range(2, 5):
        _train_step(model, opt, rank, i)
    out["steps_after"], out["refreshes_after"] = st.steps, len(st.history)
    # geometry="none": nothing is mapped, so nothing is selected; an optimizer that steps only the
    # biases (not the managed weights) leaves select_metric nothing to choose
    plain = MLP(64)
    biases = torch.optim.SGD([p for n, p in plain.named_parameters() if n.endswith("bias")], lr=0.01)
    try:
        gift_compile.apply(plain, GiftConfig(format="fp8_e4m3", geometry="none", min_numel=1024), optimizer=biases,
                           fuse=False)
        out["none_geometry"] = "accepted"
    except Exception as e:
        out["none_geometry"] = f"{type(e).__name__}: {e}"
    return out


def test_a_recreated_optimizer_reattaches_and_the_old_one_is_released():
    """Before: `apply(model, cfg, optimizer=opt2)` returned silently: `state.steps` froze at 2,
    no refresh ran, the old optimizer stayed alive in the hooks; `geometry="none"` with an
    optimizer lacking the managed weights was refused ("cannot choose select_metric")."""
    for r in run_ranks(_reattach_body, 2, timeout=FAST):
        assert r["steps_before"] == 2 and r["steps_after"] == 5, r
        assert r["refreshes_after"] > r["refreshes_before"], r  # refresh_every=2: step 4 refreshed
        assert r["old_released"], r
        assert r["none_geometry"] == "accepted", r["none_geometry"]


# ---- class 9: recipe overrides -----------------------------------------------------------------------


def test_a_recipe_override_that_conflicts_names_the_recipe_and_what_the_user_typed():
    """Before: `recipe("muon-int2-leaky-ef", error_feedback=False)` failed on
    `error_feedback_decay`, a field the user never typed, and never named the recipe; an
    explicit field replacing a recipe's was not logged."""
    from gift_compile.recipes import RecipeConflict, recipe

    log = _gift_log()
    with pytest.raises(RecipeConflict) as err:
        recipe("muon-int2-leaky-ef", error_feedback=False, seed=3)
    message = str(err.value)
    assert "recipe 'muon-int2-leaky-ef'" in message and "does not combine with error_feedback=False:" in message
    assert "seed" not in message and err.value.field == "error_feedback"  # only the culprit the user typed
    assert "Override error_feedback_decay as well" in message
    cfg = recipe("muon-int2-leaky-ef", format="int3", seed=3)
    assert cfg.format == "int3"
    replaced = [m for m in log if "set explicitly" in m]
    assert len(replaced) == 2 and "format='int3' (recipe: 'int2')" in replaced[-1], log
    assert "seed" not in replaced[-1]  # a field the recipe does not set replaces nothing


# ---- class 8: second-hop residuals across layouts ------------------------------------------------


def _second_hop_body(rank: int, world: int) -> dict:
    from gift_compile.exchange import collectives as C

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world

    def cfg(per_node: int) -> GiftConfig:
        return GiftConfig(format="int2", second_hop_error_feedback=True, ranks_per_node=per_node)

    residuals = {}
    for per_node in (0, 2):
        residual = torch.zeros(64 // world, 64)
        for _ in range(3):
            C.all_reduce(x, dist.group.WORLD, cfg(per_node), second_hop_residual=residual)
        residuals[per_node] = residual
    # resume the 2 x 2 run's residual in the same layout and flat: the next step's error
    errors = {}
    for per_node in (2, 0):
        out = C.all_reduce(x, dist.group.WORLD, cfg(per_node), second_hop_residual=residuals[2].clone())
        errors[per_node] = float((out - exact).norm() / exact.norm())
    return {"norms": {k: float(v.norm()) for k, v in residuals.items()}, "errors": errors}


def test_second_hop_residuals_are_kept_at_one_scale_whatever_the_layout():
    """Before: a 2 x 2 run kept its second-hop residual at the sum's scale (stage 2 summed, the
    mean was taken at the end), a flat run at the mean's, so a checkpoint moved between them
    resumed with a residual `world` times off (error 1.59 against 0.56). After: both at the mean's."""
    for r in run_ranks(_second_hop_body, 4, timeout=FAST):
        ratio = r["norms"][2] / r["norms"][0]
        assert 0.5 < ratio < 2, r["norms"]  # before: about 4 (the world size)
        assert r["errors"][0] < 1.5 * r["errors"][2], r["errors"]


# ---- class 7: wrapping orders ------------------------------------------------------------------------


def _wrapping_body(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for order in ("sequential", "compiled"):
        model = MLP(64)
        gift_compile.apply(model, GiftConfig(**CFG), fuse=False)
        outer = fully_shard(nn.Sequential(model) if order == "sequential" else torch.compile(model))
        try:
            outer(torch.randn(4, 64)).sum().backward()
            out[order] = "sent twice"
        except Exception as e:
            out[order] = f"{type(e).__name__}: {e}"

    # the valid split: DDP ignores `inner`'s parameters, GIFT syncs `inner`
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.head = MLP(64), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.inner(x))

    net = Outer()
    gift_compile.apply(net.inner, GiftConfig(**CFG), fuse=False)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        net, [f"inner.{n}" for n, _ in net.inner.named_parameters()])
    ddp = nn.parallel.DistributedDataParallel(net)
    try:
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
        ddp(x).sum().backward()
        out["split"] = (gift_compile.state(net.inner).comm_totals()["calls"], net.inner.fc1.weight.grad.clone(),
                        net.head.weight.grad.clone())
    except Exception as e:
        out["split"] = f"{type(e).__name__}: {e}"
    return out


def test_wrapping_after_apply_is_refused_and_the_valid_ddp_split_is_accepted():
    """Before: `apply(m); fully_shard(nn.Sequential(m))` and `apply(m); fully_shard(torch.compile(m))`
    ran, every gradient sent twice (GIFT's codes, then FSDP2's reduce-scatter), because the check
    expected DTensor weights where FSDP2 swaps in unsharded ones; DDP ignoring a submodule's
    parameters with GIFT on that submodule was refused as double sending."""
    results = run_ranks(_wrapping_body, 2, timeout=FAST)
    for r in results:
        for order in ("sequential", "compiled"):
            assert r[order].startswith("RuntimeError") and "fully_shard (FSDP2) was applied after" in r[order], \
                (order, r[order])
        assert not isinstance(r["split"], str), r["split"]
    (calls0, fc0, head0), (calls1, fc1, head1) = results[0]["split"], results[1]["split"]
    assert calls0 > 0 and calls1 > 0 and torch.equal(fc0, fc1) and torch.equal(head0, head1)  # both synced, each once


def _partly_sharded_body(rank: int, world: int) -> dict:
    """`fully_shard` on some submodules only, then `apply`; then the way out the error names."""
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    cfg = GiftConfig(format="fp8_e4m3", geometry="none", min_numel=1024, exclude=())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    model = MLP(64)
    fully_shard(model.fc1)  # fc2 (managed) and out lie in no FSDP module
    try:
        gift_compile.apply(model, cfg, fuse=False)
        out["some"] = "applied"
    except Exception as e:
        out["some"] = f"{type(e).__name__}: {e}"
    out["left_clean"] = getattr(model, "_gift_state", None) is None
    fully_shard(model)  # the way out: the root covers every parameter left over
    gift_compile.apply(model, cfg, fuse=False)
    model(x).sum().backward()
    out["root"] = (gift_compile.report(model).managed, model.fc2.weight.grad.full_tensor())
    # only the small head outside: accepted (no managed weight there), the head named
    log = _gift_log()
    model = MLP(64)
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    gift_compile.apply(model, cfg, fuse=False)
    model(x).sum().backward()
    out["head_warnings"] = [m for m in log if "lie in no FSDP module" in m]
    out["head"] = (gift_compile.report(model).managed, model.fc2.weight.grad.full_tensor(), model.out.weight.grad.clone())
    return out


def test_a_weight_in_no_fsdp_module_is_refused_not_reported_managed():
    """Before: with `fully_shard` on `fc1` only, `apply` listed `fc2.weight` as managed (and its
    bytes as compressed traffic) though no collective carried its gradient: the ranks' gradients
    differed. After: `apply` raises on every rank naming the weight and the way out (fully_shard
    on the root), and leaves the model as it was; parameters outside that GIFT does not manage
    (a small head) are accepted and named in a warning."""
    results = run_ranks(_partly_sharded_body, 2, timeout=FAST)
    for r in results:
        assert r["some"].startswith("ValueError") and "fc2.weight lie in no FSDP module" in r["some"], r["some"]
        assert "fully_shard(model) on the root" in r["some"] and "fc1.weight" not in r["some"], r["some"]
        assert r["left_clean"]
        assert r["root"][0] == ("fc1.weight", "fc2.weight"), r["root"][0]
        assert r["head"][0] == ("fc1.weight", "fc2.weight"), r["head"][0]
        assert len(r["head_warnings"]) == 1 and "out.weight, out.bias" in r["head_warnings"][0], r["head_warnings"]
    assert torch.equal(results[0]["root"][1], results[1]["root"][1])  # carried: the same on both ranks
    assert torch.equal(results[0]["head"][1], results[1]["head"][1])
    assert not torch.equal(results[0]["head"][2], results[1]["head"][2])  # FSDP2's own: the head stays per rank
