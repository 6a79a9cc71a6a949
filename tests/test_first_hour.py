"""What a new user reads off a run (issue 57): the compression figures on a two-node layout and
on one node, `report(model)` before and after the first refresh, and the mismatches GIFT says
out loud (recipe vs optimizer, a block size the format does not use).

Nodes are simulated on 4 gloo ranks with `GiftConfig.ranks_per_node` (2 x 2 against 1 x 4).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from mlp import MLP
from multirank import run_ranks

INT2 = dict(format="int2", block_size=32)


def _int2_ddp_run(rank: int, world: int) -> dict[str, object]:
    """Three DDP steps of int2 GIFT as 2 nodes x 2, then as one node of 4 (`ranks_per_node=4`):
    each state's `comm_totals()` and `compression()`."""
    import contextlib
    import io

    out: dict[str, object] = {}
    # progress lines every step on 2 x 2, switched off on one node
    for name, per_node, progress in (("two_nodes", 2, 1), ("one_node", 4, 0)):
        model = MLP(64, 256)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gift_compile.apply(ddp, GiftConfig(**INT2, geometry="none", min_numel=1024, exclude=(),
                                           ranks_per_node=per_node, progress_every=progress), optimizer=opt, fuse=False)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            for i in range(3):
                x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * i + rank))
                ddp(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        st = gift_compile.state(ddp)
        out[name] = {"totals": st.comm_totals(), "compression": st.compression(), "report": str(gift_compile.report(ddp)),
                     "progress": printed.getvalue().splitlines()}
        gift_compile.remove(ddp)
    return out


def test_network_compression_counts_what_crosses_nodes_and_the_total_is_named_apart() -> None:
    """2 x 2 at int2: the network's figure (bytes across nodes against an fp32 exchange over the
    same two levels) is several times smaller than fp32, while the whole total, which adds the
    node's full-precision reduce-scatter, is a separately named and far smaller figure. On one
    node nothing is called cross-node."""
    for rank, r in enumerate(run_ranks(_int2_ddp_run, 4)):
        two, one = r["two_nodes"], r["one_node"]
        t, c = two["totals"], two["compression"]
        assert t["cross_wire"] > 0 and t["node_wire"] > 0 and t["cross_wire"] + t["node_wire"] == t["wire"]
        # an fp32 exchange over the same layout sends the node-reduced half across nodes
        assert 0 < t["cross_baseline"] < t["baseline"]
        assert c["network"] is not None and c["network"] > 4.0, c
        assert set(c) == {"network", "total"} and c["total"] < c["network"] / 2, c
        t1, c1 = one["totals"], one["compression"]
        assert t1["cross_wire"] == 0 and t1["cross_baseline"] == 0 and t1["node_wire"] == t1["wire"] > 0, t1
        assert c1["network"] is None and c1["total"] > 4.0, c1
        # the report says the same figures under the same names
        assert f"{c['network']:.2f}x fewer across nodes (the network)" in two["report"], two["report"]
        assert f"in total, inside nodes and across, {c['total']:.2f}x fewer than fp32" in two["report"]
        assert f"nothing crossed a network; {c1['total']:.2f}x fewer than fp32 in total" in one["report"], one["report"]
        # the progress line: one per step on rank 0 only, the same figures; none when switched off
        if rank == 0:
            assert [p.split(":")[0] for p in two["progress"]] == ["GIFT step 1", "GIFT step 2", "GIFT step 3"]
            per_step = t["wire"] / 3 / 1e6
            assert f"{per_step:.3f} MB/step sent, {c['network']:.2f}x fewer bytes across nodes than fp32" in two["progress"][2]
            assert "0 of 2 layers mapped" in two["progress"][2], two["progress"]
        else:
            assert two["progress"] == []
        assert one["progress"] == []


def _report_run(rank: int, world: int) -> dict[str, object]:
    """The docs' small model under Muon + AdamW at int2 on 2 ranks, through the first refresh: the
    report before it, after it, and the rank's `gift_compile` INFO lines about refreshes."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("gift_compile")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 256))
    # Muon for the matrices, AdamW for the rest: the map (lowrank) pays on these low-rank gradients
    opts = [torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in model.parameters() if p.ndim < 2], lr=1e-3)]
    gift_compile.apply(model, GiftConfig(**INT2), optimizer=opts, fuse=False)
    out: dict[str, object] = {}
    first = gift_compile.report(model).first_refresh
    for step in range(first):
        if step == 3:
            out["before"] = gift_compile.report(model)
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1000 * rank + step))
        model(x).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["after"] = gift_compile.report(model)
    out["mapped"] = sorted(n for n, layer in gift_compile.state(model).layers.items() if layer.selected)
    out["refresh_lines"] = [m for m in lines if m.startswith("GIFT refresh at step")]
    log.removeHandler(handler)
    return out


def test_the_report_is_current_before_and_after_the_first_refresh() -> None:
    """Before the first refresh the report says when it comes and that no layer is mapped yet;
    after it, the mapped layers (what the state runs), the refresh's step and the next one's; the
    rank-0 log line at the refresh says the same, and no other rank logs it."""
    ranks = run_ranks(_report_run, 2)
    for rank, r in enumerate(ranks):
        before, after = r["before"], r["after"]
        assert before.selected is None and before.step == 3 and before.last_refresh is None
        assert any(f"first refresh (optimizer step {before.first_refresh}; now after step 3)" in line
                   for line in before.lines()), before.lines()
        assert r["mapped"], "the measured selection mapped no layer: the test cannot tell a stale report"
        assert after.selected == tuple(r["mapped"]) and after.step == before.first_refresh
        text = str(after)
        assert f"mapped ({len(r['mapped'])} of 3): {', '.join(r['mapped'])}" in text, text
        assert f"last refresh: optimizer step {before.first_refresh}: {len(r['mapped'])} of 3 managed layers" in text
        assert f"next refresh at optimizer step {after.next_refresh}" in text and after.next_refresh > after.step
        if rank == 0:
            assert len(r["refresh_lines"]) == 1, r["refresh_lines"]
            line = r["refresh_lines"][0]
            assert f"mapped: {', '.join(r['mapped'])}; next refresh at optimizer step {after.next_refresh}" in line
        else:
            assert r["refresh_lines"] == [], r["refresh_lines"]


def test_a_block_size_the_format_does_not_read_is_refused() -> None:
    """nvfp4's blocks are 16 and mxfp8's 32 whatever block_size says: another value is refused
    naming the field and the way out (the config is built the same on every rank, so every rank
    raises). The default and the format's own block are accepted."""
    import pytest

    from gift_compile.config import GiftConfigError

    for fmt, block, own in (("nvfp4", 64, 16), ("mxfp8", 48, 32)):
        with pytest.raises(GiftConfigError, match=rf"{fmt}: {own}\), so {block} would be ignored") as err:
            GiftConfig(format=fmt, block_size=block)
        assert err.value.field == "block_size" and "leave block_size out" in str(err.value)
        GiftConfig(format=fmt)
        GiftConfig(format=fmt, block_size=own)
    GiftConfig(format="fp8_e4m3", scaling="block", block_size=64)  # a block size it reads
    GiftConfig(format="nvfp4", layer_formats="fc*=int2", block_size=16)  # int2 reads it


def _recipe_run(rank: int, world: int) -> dict[str, list[str]]:
    """`apply` of a Muon recipe under AdamW and under Muon + AdamW: the warnings each logs."""
    import logging

    from gift_compile.recipes import recipe

    out: dict[str, list[str]] = {}
    for name, muon in (("adamw", False), ("muon", True)):
        lines: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("gift_compile").addHandler(handler)
        model = MLP(64, 256)
        mats = [p for p in model.parameters() if p.ndim == 2]
        opts = ([torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW([p for p in model.parameters() if p.ndim < 2])]
                if muon else [torch.optim.AdamW(model.parameters())])
        gift_compile.apply(model, recipe("muon-nvfp4", min_numel=1024), optimizer=opts, fuse=False)
        gift_compile.remove(model)
        logging.getLogger("gift_compile").removeHandler(handler)
        out[name] = [m for m in lines if "recipe" in m]
    return out


def test_a_recipe_under_another_optimizer_is_warned_on_every_rank() -> None:
    """A Muon recipe on an AdamW run: every rank warns, naming the recipe, its optimizer and the
    run's; under Muon nothing is said."""
    for r in run_ranks(_recipe_run, 2):
        assert len(r["adamw"]) == 1, r
        assert all(s in r["adamw"][0] for s in ("'muon-nvfp4'", "measured under muon", "AdamW", "adamw-int3")), r
        assert r["muon"] == [], r


def test_gift_train_help_lists_the_recipe_flag_and_no_missing_folder() -> None:
    from gift_compile.torchtitan_ext.launcher import gift_flags_help

    text = gift_flags_help()
    assert "--gift.recipe str" in text and "muon-int2-leaky-ef (muon)" in text
    assert "configs/recipes" not in text


def _odd_rows_run(rank: int, world: int) -> list[str]:
    """FSDP2 `apply` under AdamW (so "auto" looks ahead at the managed weights) of a model whose
    first linear has rows that do not split over the ranks: the warnings about it."""
    import logging

    from torch.distributed.fsdp import fully_shard

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gift_compile").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 129), nn.GELU(), nn.Linear(129, 64))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    gift_compile.apply(model, GiftConfig(format="nvfp4", min_numel=1024), optimizer=torch.optim.AdamW(model.parameters()),
                       fuse=False)
    logging.getLogger("gift_compile").removeHandler(handler)
    return [m for m in lines if "is not one of GIFT's layers" in m]


def test_a_weight_left_out_of_the_layers_is_said_once_per_rank() -> None:
    for lines in run_ranks(_odd_rows_run, 2):
        assert lines == ["GIFT: 0.weight is not one of GIFT's layers: 129 rows do not split over 2 ranks; it travels "
                         "with the gradients outside them"], lines


def _readme_quickstart() -> tuple[str, str]:
    """The README's first-run script (the fence after `# quickstart.py`) and the output printed
    under it (the next text fence)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = re.search(r"```python\n(# quickstart\.py\n.*?)```.*?```text\n(.*?)```", text, flags=re.S)
    assert found, "README.md: no quickstart script followed by its output"
    return found.group(1), found.group(2)


def _quickstart_rank(rank: int, world: int) -> str:
    """The script as written on this gloo rank, as torchrun would start it (LOCAL_WORLD_SIZE set,
    the process group already made here), its codec eager (`fuse=False`: the same numbers
    without minutes of compiling); what it prints."""
    import contextlib
    import functools
    import io
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group = lambda *args, **kwargs: None  # this spawned rank's copy only
    gift_compile.apply = functools.partial(gift_compile.apply, fuse=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_readme_quickstart()[0], "README.md:quickstart.py", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def test_the_readme_quickstart_prints_what_the_readme_shows() -> None:
    """The README's first run, as written, prints its expected output on rank 0 (progress lines
    and the report, a layer mapped at the first refresh) and nothing on rank 1."""
    script, expected = _readme_quickstart()
    assert "mapped (1 of 2)" in expected or "mapped (2 of 2)" in expected, expected
    out = run_ranks(_quickstart_rank, 2)
    assert out[0] == expected, out[0]
    assert out[1] == ""
