"""Structure the package promises: declared state fields only, no process-global state that
grows or outlives its owner, one bucket helper for every eager path."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch._inductor import config as inductor_config

import gift_compile
from gift_compile.config import GiftConfig
from gift_compile.exchange import agreement
from gift_compile.exchange import collectives as C
from gift_compile.exchange.plan import ItemPlan
from gift_compile.passes import gift_pass
from gift_compile.passes.inductor import GiftGraphPass, package_sources
from gift_compile.runtime.state import GiftState

ROOT = Path(__file__).resolve().parent.parent


def test_gift_state_refuses_undeclared_attributes():
    st = GiftState(GiftConfig(geometry="lowrank"), None)
    st.adapters["an adapter"] = object()  # adapters keep their own objects in the one generic slot
    with pytest.raises(AttributeError):
        st.undeclared_timer = object()


def test_importing_the_package_changes_no_inductor_config():
    code = ("import torch._inductor.config as c; before = c.post_grad_custom_post_pass; "
            "import gift_compile, gift_compile.passes, gift_compile.exchange.mark; "
            "assert c.post_grad_custom_post_pass is before is None, c.post_grad_custom_post_pass")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def _gift_passes() -> list[object]:
    current = inductor_config.post_grad_custom_post_pass
    passes = current if isinstance(current, (list, tuple)) else [current]
    return [p for p in passes if isinstance(p, GiftGraphPass)]


def test_the_pass_lives_as_long_as_a_managed_model_and_keeps_the_users_pass():
    gc.collect()
    assert not _gift_passes()

    def user_pass(graph: fx.Graph) -> None:
        return None

    with inductor_config.patch(post_grad_custom_post_pass=user_pass):
        a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        gift_compile.apply(a, GiftConfig())
        gift_compile.apply(b, GiftConfig())
        assert len(_gift_passes()) == 1 and user_pass in inductor_config.post_grad_custom_post_pass
        gift_compile.remove(a)
        assert len(_gift_passes()) == 1  # b still holds it
        del b
        gc.collect()
        assert inductor_config.post_grad_custom_post_pass is user_pass


def test_rewrite_reports_are_bounded():
    start = gift_pass.reports_seen()
    for _ in range(gift_pass.MAX_REPORTS + 5):
        gift_pass.rewrite_gradient_collectives(fx.Graph())
    assert len(gift_pass.last_reports()) == gift_pass.MAX_REPORTS
    assert gift_pass.reports_seen() == start + gift_pass.MAX_REPORTS + 5
    assert len(gift_pass.last_reports(since=gift_pass.reports_seen() - 3)) == 3
    with pytest.raises(RuntimeError, match="were dropped"):
        gift_pass.last_reports(since=start)


def test_the_checked_plans_are_bounded(monkeypatch):
    """The plans whose description this process compared across ranks: a bounded LRU, so a
    run whose plans keep changing does not grow it (a dropped plan is compared once more)."""
    monkeypatch.setattr(agreement, "_CHECKED_PLANS", type(agreement._CHECKED_PLANS)())
    for fp in range(agreement.MAX_CHECKED_PLANS + 5):
        agreement._remember_checked(("g", fp))
    agreement._remember_checked(("g", 5))  # used again: now the most recent
    agreement._remember_checked(("g", -1))
    kept = list(agreement._CHECKED_PLANS)
    assert len(kept) == agreement.MAX_CHECKED_PLANS
    assert kept[-2:] == [("g", 5), ("g", -1)] and ("g", 6) not in kept and ("g", 7) in kept


def test_the_pass_cache_key_hashes_the_package_modules_found_by_the_import_system():
    names = {"/".join(Path(p).parts[-2:]) for p in package_sources()}
    assert {"gift_compile/__init__.py", "exchange/mark.py", "geometry/table.py", "exchange/collectives.py",
            "passes/gift_pass.py", "passes/inductor.py"} <= names
    # Every layer subpackage's modules are in the key, not only the package's top level.
    assert {"codec/__init__.py", "codec/spec.py", "codec/scales.py", "codec/codes.py", "exchange/accounting.py",
            "exchange/agreement.py", "runtime/state.py", "frameworks/fsdp2.py"} <= names
    assert all(Path(p).is_file() for p in package_sources())
    assert GiftGraphPass().uuid() == GiftGraphPass().uuid()


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_sync_buffer_cuts_runs_and_copies_back_every_segment(op):
    """One rank: the managed segment comes back quantized (int4 round trip), the full-precision
    ones bit-exact, each at its own place in `out`."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(3 + 8 * 16 + 5, generator=gen)
    managed = ItemPlan(name="w", rows=8, cols=16, format="int4", block_size=16, scaling="block")
    segments = [C.Segment("a", 1, 3), C.Segment("w", 8, 16, managed, C.ItemTensors(())), C.Segment("b", 1, 5)]
    out = torch.full_like(buf, float("nan"))
    outs = C.sync_buffer(buf, segments, C.Shared(), op=op, group=None, average=False, out=out)
    assert [tuple(o.shape) for o in outs] == [(3,), (8, 16), (5,)]
    assert torch.equal(out[:3], buf[:3]) and torch.equal(out[-5:], buf[-5:])
    w, got = buf[3:-5].view(8, 16), out[3:-5].view(8, 16)
    assert not torch.equal(got, w) and float((got - w).norm() / w.norm()) < 0.2


def test_fsdp2_internals_are_read_only_on_a_tested_torch():
    from gift_compile.frameworks.fsdp_internals import check_torch

    check_torch()  # the installed torch is a tested one
    check_torch("2.14.1")
    with pytest.raises(RuntimeError, match="tested on torch 2.13, 2.14; this is torch 2.15.0"):
        check_torch("2.15.0")



# Inductor/dynamo modules that are not an extension point: only the fence may read them.
_PRIVATE_INDUCTOR = ("torch._inductor.pattern_matcher", "torch._inductor.virtualized", "torch._inductor.fx_passes",
                     "torch._guards")


def test_inductor_internals_are_read_only_behind_the_fence():
    """The splice's private Inductor helpers are imported in `passes/inductor_internals.py` and
    nowhere else in the package, and are used only on a tested torch."""
    from gift_compile.passes.inductor_internals import check_torch

    readers = sorted(str(p.relative_to(ROOT)) for folder in ("gift_compile", "passes") for p in (ROOT / folder).rglob("*.py")
                     if any(name in p.read_text() for name in _PRIVATE_INDUCTOR))
    assert readers == ["passes/inductor_internals.py"], readers
    check_torch()
    with pytest.raises(RuntimeError, match="graph pass splices .* tested on torch 2.13, 2.14; this is torch 2.11.0"):
        check_torch("2.11.0")

@pytest.mark.parametrize("error_feedback,second_hop,residual_format,replica",
                         [(False, False, "fp32", False), (True, False, "fp8_e4m3", False), (True, True, "int4", True)])
def test_the_marks_tensor_order_has_one_definition(error_feedback, second_hop, residual_format, replica):
    """`pack_mark_tensors` writes the order `MarkLayout` defines and every reader gets back the
    very tensors it was given (a LayerState's own mark included)."""
    from gift_compile.exchange.mark import (MarkLayout, pack_mark_tensors, split_mark_tensors, unpack_mark_tensors,
                                            unpack_replica_shared)

    config = GiftConfig(geometry="lowrank", error_feedback=error_feedback, second_hop_error_feedback=second_hop,
                        residual_format=residual_format, select="all")
    st = GiftState(config, None)
    layer = st.add_layer("w", (64, 32), "cpu")
    hop = C.Shared(st.seed, torch.tensor(1), torch.zeros(C.N_COUNTERS, dtype=torch.int64))
    if replica:
        layer.set_replica_hop("fp8_e4m3", hop)
    layer.selected = True
    layer._replan()
    tensors = layer.mark_tensors(st.shared)
    assert tensors == pack_mark_tensors(layer.plan, layer.tensors(), st.shared, hop if replica else None)
    own, shared, rep = split_mark_tensors(layer.plan, tensors)
    assert (len(own), len(shared), len(rep)) == tuple(MarkLayout.of(layer.plan))
    item, got_shared = unpack_mark_tensors(layer.plan, tensors)
    want = layer.tensors()
    assert len(item.transform) == len(want.transform) > 0
    assert all(a is b for a, b in zip(item.transform, want.transform))
    assert (item.residual is None) == (want.residual is None) and (item.second_hop_residual is None) == (not second_hop)
    if want.residual is not None:
        assert all(a is b for a, b in zip(item.residual, want.residual))
    assert item.probe is layer.probe and item.seed_offset is layer.seed_offset
    assert all(a is b for a, b in zip(got_shared, st.shared))
    if replica:
        r = unpack_replica_shared(layer.plan, tensors)
        assert r.seed is st.seed and r.rank is hop.rank and r.counters is hop.counters
    with pytest.raises(ValueError, match="carries 1 tensors"):
        split_mark_tensors(layer.plan, tensors[:1])
    with pytest.raises(RuntimeError, match="replica"):
        pack_mark_tensors(layer.plan, layer.tensors(), st.shared, None if replica else hop)


def test_the_replica_hop_plan_has_one_rule():
    """HSDP's replica hop (`replica_hop_plan`, run by FSDP2's hook and by the pass): managed shards
    at the replica format without error feedback, an fp32 format and other items raw."""
    from gift_compile.exchange.plan import replica_hop_plan

    managed = ItemPlan(name="w", rows=8, cols=16, format="nvfp4", error_feedback=True, second_hop_error_feedback=True,
                       error_feedback_decay=0.9, residual_format="fp8_e4m3")
    other = ItemPlan.passthrough("b", 16, torch.float32)
    plan = replica_hop_plan([managed, other], "fp8_e4m3", 2, None, False)
    hop, raw = plan.items
    assert (hop.format, hop.rows, hop.error_feedback, hop.second_hop_error_feedback, hop.error_feedback_decay,
            hop.residual_format) == ("fp8_e4m3", 8, False, False, 1.0, "fp32")
    assert raw == other and (plan.op, plan.world, plan.average) == ("all_reduce", 2, False)
    exact = replica_hop_plan([managed, other], "fp32", 2, None, True).items
    assert [i.managed for i in exact] == [False, False] and exact[0].numel == managed.numel


# --- the rooms of bench/ and the two sides of torchtitan_ext/ (docs/architecture.md) -------------

# bench's rooms, lowest first, as each room's `__init__` docstring declares them: a room imports
# only rooms of a lower level (never one beside it); `bench.run` and the package sit on top.
BENCH_ROOMS: dict[str, int] = {"bench.lib": 0, "bench.fidelity": 1, "bench.convergence": 2, "bench.step_model": 2,
                               "bench.cluster": 2, "bench.gpu": 2, "bench.pages": 3, "bench.run": 4, "bench": 4}
MAX_ROOM_MODULES = 15
STAND_INS = "gift_compile.torchtitan_ext.cpu"
# The integration's only way to a stand-in: a process entry point activating the CPU shims
# before torchtitan is imported, inside its `main` (each module's docstring says why).
LAUNCHER_SIDE = {("gift_compile.torchtitan_ext.train", f"{STAND_INS}.cpu_compat"),
                 ("gift_compile.torchtitan_ext.launcher", f"{STAND_INS}.cpu_compat")}


def bench_modules(root: Path = ROOT) -> dict[str, Path]:
    """The bench's modules (its results folder holds measurement scripts as records, not code)."""
    from tests.test_layers import modules_under

    return {m: p for m, p in modules_under(root / "bench", "bench").items() if not m.startswith("bench.results")}


def room_of(module: str, rooms: dict[str, int]) -> str:
    """The room (longest listed prefix) of `module`; raises for a module in no room."""
    found = [r for r in rooms if module == r or module.startswith(r + ".")]
    if not found:
        raise KeyError(f"{module} is in no room of tests/test_architecture.py's BENCH_ROOMS")
    return max(found, key=len)


def room_violations(graph: dict[str, dict[str, int]], rooms: dict[str, int]) -> list[str]:
    """Every import from a room into one of the same or a higher level (other than its own)."""
    problems = []
    for a, edges in sorted(graph.items()):
        for b, line in sorted(edges.items()):
            ra, rb = room_of(a, rooms), room_of(b, rooms)
            if ra != rb and rooms[rb] >= rooms[ra]:
                problems.append(f"{a} (room {ra}) imports {b} (room {rb}, not below it), line {line}")
    return problems


def oversized_rooms(root: Path, limit: int = MAX_ROOM_MODULES) -> list[str]:
    """Each room folder of `root` (a folder with an `__init__.py`) holding more than `limit` modules."""
    return [f"{d.name}: {n} modules" for d in sorted(root.iterdir()) if (d / "__init__.py").is_file()
            for n in [sum(1 for p in d.glob("*.py") if p.name != "__init__.py")] if n > limit]


def stand_in_imports(modules: dict[str, Path], stand_ins: str = STAND_INS,
                     allowed: set[tuple[str, str]] = LAUNCHER_SIDE) -> list[str]:
    """Every import of a stand-in by an integration module, except an `allowed` (module, target)
    pair written inside a function."""
    from tests.test_layers import _imported

    problems = []
    for module, path in sorted(modules.items()):
        if module == stand_ins or module.startswith(stand_ins + "."):
            continue
        tree = ast.parse(path.read_text(), str(path))
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom) and any(n in modules for n in names[:-1]):
                names = names[:-1]  # `from pkg import submodule`: the submodule, not pkg
            targets = set()
            for name in names:
                while name and name not in modules:  # a name inside a module: that module
                    name = name.rpartition(".")[0]
                targets.add(name)
            for target in sorted(t for t in targets if t == stand_ins or t.startswith(stand_ins + ".")):
                if (module, target) in allowed and id(node) in in_function:
                    continue
                problems.append(f"{module} imports the stand-in {target} (line {node.lineno})")
    return problems


def test_bench_rooms_import_only_downward_and_close_no_cycle():
    from tests.test_layers import cycles, import_graph

    graph = import_graph(bench_modules())
    assert not room_violations(graph, BENCH_ROOMS), "\n".join(room_violations(graph, BENCH_ROOMS))
    assert not cycles(graph)
    # every room folder is in the table and says in its docstring what lives there
    folders = {f"bench.{d.name}" for d in (ROOT / "bench").iterdir() if (d / "__init__.py").is_file()}
    assert folders == {r for r in BENCH_ROOMS if r.count(".") == 1 and r != "bench.run"}
    for room in folders:
        doc = ast.get_docstring(ast.parse((ROOT / room.replace(".", "/") / "__init__.py").read_text()))
        assert doc and len(doc) > 200, f"{room}'s __init__ says what lives there and what it may import"


def test_no_bench_room_is_over_the_limit():
    assert not oversized_rooms(ROOT / "bench")


def test_no_cycle_in_the_package_or_torchtitan_ext():
    from tests.test_layers import cycles, import_graph, package_modules

    assert not cycles(import_graph(package_modules()))


def test_the_integration_never_imports_a_stand_in():
    from tests.test_layers import package_modules

    modules = {m: p for m, p in package_modules().items() if m.startswith("gift_compile.torchtitan_ext")}
    assert f"{STAND_INS}.cpu_compat" in modules and "gift_compile.torchtitan_ext.hooks" in modules
    assert not stand_in_imports(modules), "\n".join(stand_in_imports(modules))


def test_the_room_checkers_report_violations(tmp_path):
    """Synthetic rooms and packages: an upward and a sideways import between rooms, a room over
    the limit, and an integration importing a stand-in at module level, at function level from a
    module not allowed, and from an allowed one at module level; the allowed function-level
    import passes."""
    rooms = {"b.low": 0, "b.mid": 1, "b.side": 1, "b.top": 2}
    graph = {"b.low.x": {"b.top.y": 3}, "b.mid.m": {"b.side.s": 4, "b.low.x": 1}, "b.top.y": {"b.mid.m": 2},
             "b.side.s": {}}
    assert room_violations(graph, rooms) == ["b.low.x (room b.low) imports b.top.y (room b.top, not below it), line 3",
                                             "b.mid.m (room b.mid) imports b.side.s (room b.side, not below it), line 4"]
    with pytest.raises(KeyError, match="in no room"):
        room_of("elsewhere.z", rooms)
    big = tmp_path / "bench" / "big"
    big.mkdir(parents=True)
    for i in range(MAX_ROOM_MODULES + 1):
        (big / f"m{i}.py").write_text("")
    (big / "__init__.py").write_text("")
    assert oversized_rooms(tmp_path / "bench") == [f"big: {MAX_ROOM_MODULES + 1} modules"]
    (big / "m0.py").unlink()
    assert oversized_rooms(tmp_path / "bench") == []
    files = {"ext/__init__.py": "", "ext/cpu/__init__.py": "", "ext/cpu/shim.py": "from ext import hooks\n",
             "ext/hooks.py": "from ext.cpu import shim\n",
             "ext/telemetry.py": "def f():\n    from .cpu import shim\n",
             "ext/train.py": "def main():\n    from .cpu import shim\n",
             "ext/launcher.py": "from ext.cpu.shim import x\n"}
    modules = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__")] = path
    allowed = {("ext.train", "ext.cpu.shim"), ("ext.launcher", "ext.cpu.shim")}
    assert stand_in_imports(modules, "ext.cpu", allowed) == [
        "ext.hooks imports the stand-in ext.cpu.shim (line 1)", "ext.launcher imports the stand-in ext.cpu.shim (line 1)",
        "ext.telemetry imports the stand-in ext.cpu.shim (line 2)"]
