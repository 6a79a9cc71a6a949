"""Compilations do not grow with the number of distinct selection patterns or with depth
(issue 31): the exchange compiles one body per item plan (`gift_compile.exchange.compiled_bodies`),
not one per bucket plan, so blocks whose layers take different paths share bodies, a
selection that changes at every refresh adds none past the first few, and dynamo's
per-function `recompile_limit` is never reached.

Small on purpose: dim 64, the feed-forward weights excluded (they would only add shapes,
hence compilations, and not patterns), 2 ranks."""

from __future__ import annotations

import torch

from multirank import run_ranks

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
CFG = dict(format="nvfp4", geometry="lowrank", rank=8, refresh_every=2, min_numel=1024, select="none",
           exclude=("*embed*", "*output*", "*feed_forward*"))


def _pattern(block: int, step: int = 0) -> tuple[bool, ...]:
    """A subset of a block's linears for every (block, step), different from block to block
    (16 patterns: 5 is odd, so 12 consecutive blocks get 12 of them) and from step to step."""
    code = (block * 5 + step * 3 + 1) % (2 ** len(LINEARS))
    return tuple(bool(code >> i & 1) for i in range(len(LINEARS)))


def _select(st: object, n_blocks: int, step: int) -> None:
    """Put each block's linears on the paths of `_pattern(block, step)`, as a refresh of
    select="auto" does (`set_selected`; a static glob selection never activates an adaptive
    map, whose transform starts as the identity, so it is the measured rule that produces
    per-block patterns)."""
    for b in range(n_blocks):
        for lin, on in zip(LINEARS, _pattern(b, step)):
            st.set_selected(st.layers[f"layers.{b}.{lin}.weight"], on)


def _model(n_blocks: int) -> torch.nn.Module:
    from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig

    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(dim=64, n_layers=n_blocks, n_heads=2, vocab_size=128, multiple_of=64,
                                     max_seq_len=16))


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def _fsdp2_body(rank: int, world: int, n_blocks: int, steps: int, change: bool, compile_blocks: bool = False) -> dict:
    """`n_blocks` fully_shard-ed blocks, a different selection per block, `steps` steps through
    `apply(..., optimizer=)` (FSDP2's hook runs the compiled exchange); with `change`, every
    block gets another pattern before every step. `compile_blocks` compiles each block as
    torchtitan does (`block.compile(fullgraph=True)`: one code object for all blocks) on
    dynamo's eager backend: the guards, hence the recompilations, are dynamo's whatever the
    backend, and the statistics hooks are the only GIFT code in an FSDP2 forward."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gift_compile
    from bench.lib.tiny_llama import loss
    from gift_compile.exchange import compiled_bodies
    from gift_compile.config import GiftConfig

    model, ref = _model(n_blocks), _model(n_blocks)
    for block in model.layers:
        if compile_blocks:
            block.compile(fullgraph=True, dynamic=False, backend="eager")
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gift_compile.apply(model, GiftConfig(**CFG), optimizer=opt)
    st = gift_compile.state(model)
    errs = []
    for step in range(steps):
        if change or step == 0:
            _select(st, n_blocks, step)
        x = _tokens(step, rank)
        loss(model(x[:, :-1]), x[:, 1:]).backward()
        if step == 0:  # the managed layers' gradients against an exact fp32 average
            ref.zero_grad()
            loss(ref(x[:, :-1]), x[:, 1:]).backward()
            for name in st.layers:
                exact = dict(ref.named_parameters())[name].grad.clone()
                dist.all_reduce(exact)
                got = dict(model.named_parameters())[name].grad.full_tensor()
                errs.append(float((got - exact / world).norm() / exact.norm()))
        opt.step()
        opt.zero_grad()
    from bench.lib.tiny_llama import TransformerBlock

    # dynamo starts at the block's forward (nn.Module's call wrappers are skipped frames)
    block_graphs = len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(TransformerBlock.forward.__code__))
    return {"totals": st.comm_totals(), "errs": errs, "stats": compiled_bodies.stats(),
            "item_plans": compiled_bodies.live_item_plans(), "selection_changes": st.selection_changes,
            "block_graphs": block_graphs}


def _check_quantized_and_bounded(r: dict) -> None:
    t = r["totals"]
    assert t["calls"] > 0 and 0 < t["wire"] < 0.8 * t["baseline"], t  # nvfp4 for the attention weights
    assert min(r["errs"]) > 1e-3 and max(r["errs"]) < 0.5, r["errs"]  # quantized, neither exact nor garbage
    # one encode and one decode body per item plan: managed [64, 64] on either path, the
    # blocks' and the root's full-precision items (by size); nothing per block or pattern
    s = r["stats"]
    assert s["bodies"] == 2 * r["item_plans"] <= 2 * 6 and s["graphs"] == s["bodies"], r
    assert s["recompiles"] == 0 and s["evicted"] == 0, r


def test_fsdp2_blocks_with_different_selections_compile_per_item_not_per_pattern() -> None:
    """12 blocks, each with another subset of its linears selected (what select="auto"
    produces): compiled per bucket, each distinct pattern was one compilation of the bucket
    body and the 9th killed the first backward (dynamo's recompile_limit)."""
    for r in run_ranks(_fsdp2_body, 2, 12, 2, False):
        _check_quantized_and_bounded(r)


def test_fsdp2_selection_changing_at_every_step() -> None:
    """3 blocks whose selection changes before every one of 8 steps (a new pattern per block
    and step: 24 bucket patterns): no new compilation after the first patterns."""
    for r in run_ranks(_fsdp2_body, 2, 3, 8, True):
        _check_quantized_and_bounded(r)
        assert r["selection_changes"] >= 8, r


def test_per_block_compiled_fsdp2_model_with_changing_selections() -> None:
    """torchtitan's compiled model: every block compiled (one code object), a selection that
    differs from block to block and changes before every step. The statistics hook's Python
    flag was a guard: the 9th distinct block pattern was FailOnRecompileLimitHit in the first
    forward. Now the block's compilations stay below dynamo's limit whatever the patterns."""
    for r in run_ranks(_fsdp2_body, 2, 12, 4, True, True):
        _check_quantized_and_bounded(r)
        # 48 block patterns ran; the block's entries (4 on torch 2.13) come from structure
        # (the first refresh's shared statistics, FSDP2's first iterations), not from patterns
        assert r["selection_changes"] >= 8 and 1 <= r["block_graphs"] <= 4, r


def _plain_compiled_body(rank: int, world: int, n_blocks: int, steps: int) -> dict:
    """A plain module compiled whole (`torch.compile(model, fullgraph=True)`, Inductor: GIFT's
    own all-reduce in the traced backward, rewritten by the pass), its selection different
    from block to block and changed before every step; an eager twin with the same selection
    gives the reference gradients. Before the selection was data (`LayerState.path_gate`),
    every distinct pattern was one compilation of the whole model: the 9th ended the run."""
    import torch.distributed as dist

    import gift_compile
    from bench.lib.tiny_llama import loss
    from gift_compile.config import GiftConfig

    torch._inductor.config.fx_graph_cache = False
    models = {"compiled": _model(n_blocks), "eager": _model(n_blocks)}
    states, opts = {}, {}
    for key, m in models.items():  # refreshes at steps 2, 4, ...: the selected layers' maps are real ones
        opts[key] = torch.optim.SGD(m.parameters(), lr=0.0)
        gift_compile.apply(m, GiftConfig(**CFG, refresh_warmup=0), optimizer=opts[key])
        states[key] = gift_compile.state(m)
    fwd = torch.compile(models["compiled"], fullgraph=True, dynamic=False)
    exact = _model(n_blocks)
    diffs, errs = [], []
    for step in range(steps):
        x = _tokens(step, rank)
        for key, m in models.items():
            _select(states[key], n_blocks, step)
            opts[key].zero_grad()
            loss((fwd if key == "compiled" else m)(x[:, :-1]), x[:, 1:]).backward()
        exact.zero_grad()
        loss(exact(x[:, :-1]), x[:, 1:]).backward()
        grads = {key: dict(m.named_parameters()) for key, m in models.items()}
        for name in states["compiled"].layers:
            got, ref = grads["compiled"][name].grad, grads["eager"][name].grad
            diffs.append(float((got - ref).abs().max()))
            g = dict(exact.named_parameters())[name].grad.clone()
            dist.all_reduce(g)
            errs.append(float((got - g / world).norm() / g.norm()))
        for opt in opts.values():
            opt.step()
    from bench.lib.tiny_llama import TinyLlama

    entries = len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(TinyLlama.forward.__code__))
    st = states["compiled"]
    return {"diffs": diffs, "errs": errs, "entries": entries, "selection_changes": st.selection_changes,
            "refreshes": len(st.history), "map_moved": [float(l.transform.tensors[1].abs().sum()) > 0
                                                        for l in st.layers.values()],
            "selected": [sum(_pattern(b, s).count(True) for b in range(n_blocks)) for s in range(steps)],
            "plan_version": st.plan_version, "totals": st.comm_totals()}


def test_plain_module_compiled_whole_with_changing_selections_compiles_once() -> None:
    """One block, 10 steps, its selection another before every step (10 distinct patterns,
    more than dynamo's `recompile_limit` of 8, which ended the run before): the model compiles
    once, plus once when the first refresh makes q/k/v share one statistic (structure,
    `plan_version`), and every managed gradient equals the eager path's (the identity codec
    for a deselected layer, the map for a selected one) to fp32 rounding, while quantized."""
    for r in run_ranks(_plain_compiled_body, 2, 1, 10, timeout=1200.0):
        assert r["entries"] <= 1 + r["plan_version"] <= 2, r["entries"]
        assert r["selection_changes"] >= 9, r
        assert r["refreshes"] >= 4 and sum(r["map_moved"]) >= 2, r  # real maps, not the identity they start as
        assert len(set(r["selected"])) > 2 and max(r["selected"]) > 0  # mixed paths, some transformed
        assert max(r["diffs"]) < 1e-6, max(r["diffs"])
        assert min(r["errs"]) > 1e-3 and max(r["errs"]) < 0.5, r["errs"]  # nvfp4: quantized, not garbage
        t = r["totals"]  # one block: the unmanaged embedding, head and feed-forward weights dominate the bytes
        assert 0 < t["wire"] < t["baseline"], t


def _mixed_bucket_body(rank: int, world: int) -> dict:
    """One bucket of a managed low-rank item, a managed identity item and a passthrough item,
    both ops, with error feedback on both hops and stochastic rounding: op by op
    (`bucket_core`) and through the per-item compiled bodies, from equal starting state."""
    import torch.distributed as dist

    from gift_compile.exchange import collectives as C
    from gift_compile.exchange import compiled_bodies
    from gift_compile.geometry import Transform
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    t = Transform("lowrank", 96, rank=8)
    a = torch.randn(256, 96, generator=torch.Generator().manual_seed(0))
    t.refresh_from(a.t() @ a, 1e-3)
    common = dict(format="nvfp4", error_feedback=True, stochastic_rounding=True, second_hop_error_feedback=True)
    low = ItemPlan(name="low", rows=16, cols=96, kind="lowrank", n_tensors=len(t.tensors), **common)
    ident = ItemPlan(name="ident", rows=32, cols=64, **common)
    gen = torch.Generator().manual_seed(rank + 1)
    xs = [torch.randn(16, 96, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(40, generator=gen)]
    out: dict = {}
    for op in ("reduce_scatter", "all_reduce"):
        plan = BucketPlan((low, ident, ItemPlan.passthrough("norm", 40, torch.float32)), world,
                          dist.group.WORLD.group_name, True, op)
        runs = {}
        for compiled in (False, True):
            state = [C.ItemTensors(t.tensors, (torch.zeros(16, 96),), None, torch.tensor(11), (torch.zeros(8, 96),)),
                     C.ItemTensors((), (torch.zeros(32, 64),), None, torch.tensor(12), (torch.zeros(16, 64),)), None]
            counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
            shared = C.Shared(torch.tensor(5), torch.tensor(rank), counters)
            results = []
            for step in range(2):  # the second step reads the residuals the first one wrote
                shared.seed.fill_(5 + step)
                outs, headers = C.run_bucket(xs, state, shared, plan, compiled=compiled)
                results.append((outs, headers))
            runs[compiled] = (results, [s for it in state[:2] for s in (*it.residual, *it.second_hop_residual)],
                              counters)
        out[op] = runs
    out["stats"] = compiled_bodies.stats()
    return out


def _identical(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))


def test_per_item_compiled_bodies_match_eager_bucket_core_bitwise() -> None:
    for res in run_ranks(_mixed_bucket_body, 2):
        for op in ("reduce_scatter", "all_reduce"):
            eager, compiled = res[op][False], res[op][True]
            assert _identical(eager, compiled), op
            assert float(eager[0][0][0][0].abs().sum()) > 0  # a real result, not zeros on both sides
        # reduce-scatter: encode + decode per item plan; all-reduce: encode, reduce_reencode, gather_decode
        assert res["stats"]["bodies"] == 3 * 2 + 3 * 3 and res["stats"]["recompiles"] == 0, res["stats"]


def test_bodies_past_the_bound_are_evicted_with_one_warning(caplog) -> None:
    """Past `MAX_BODIES` the least recently used body is dropped (logged once) and compiled
    again when it is needed: a process cycling through more item plans than the bound
    recompiles, it never fails; results stay those of the eager bucket."""
    import logging

    from gift_compile.exchange import collectives as C
    from gift_compile.exchange import compiled_bodies
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    plans = [BucketPlan((ItemPlan(name="x", rows=rows, cols=32, format="fp8_e4m3"),), 1, None, False, "reduce_scatter")
             for rows in (4, 8)]
    before, bound = compiled_bodies.stats(), compiled_bodies.MAX_BODIES
    compiled_bodies.set_max_bodies(1)
    try:
        with caplog.at_level(logging.WARNING, logger="gift_compile"):
            for plan in (*plans, plans[0]):  # the first plan's bodies were dropped: compiled again
                x = torch.randn(plan.items[0].rows, 32, generator=torch.Generator().manual_seed(0))
                got = C.run_bucket([x], [C.ItemTensors(())], C.Shared(), plan, compiled=True)[0][0]
                assert torch.equal(got, C.run_bucket([x], [C.ItemTensors(())], C.Shared(), plan)[0][0])
    finally:
        compiled_bodies.set_max_bodies(bound)
    after = compiled_bodies.stats()
    assert after["bodies"] - before["bodies"] == 6 and after["evicted"] - before["evicted"] >= 5, after
    assert after["live"] == 1 and after["recompiles"] == 0, after
    warnings = [r for r in caplog.records if "compiled codec bodies" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # once per process
