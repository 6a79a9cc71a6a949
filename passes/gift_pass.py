"""Rewrite gradient collectives of GIFT-managed weights into quantized collectives.

`find_gradient_collectives` returns one small `CollectiveMatch` per functional
`all_reduce` / `reduce_scatter_tensor` (with its `wait_tensor`) whose input is, through
shape-preserving casts and views only, the output of a `gift::mark` node; every other
collective (tensor/sequence parallel, forward all-gathers, unmanaged parameters) is left
alone. `rewrite_collective` splices the core's traced `gift_all_reduce` /
`gift_reduce_scatter` in its place, keeping the original group, world size and reduce op,
and copies the collective's metadata (`autograd_backward`, stack trace, ...) onto every new
node. `rewrite_gradient_collectives` is the entry point over a graph; it also removes marks
that feed no recognised collective (logging why, so a full-precision fallback is never
silent) and returns a `RewriteReport`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from gift_compile.collectives import CommPlan, gift_all_reduce, gift_reduce_scatter, wire_bytes_per_rank
from gift_compile.formats import FormatSpec
from gift_compile.state import LayerState, lookup_layer

logger = logging.getLogger("gift_compile")

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_COLLECTIVES = {_c10d.all_reduce.default: "all_reduce", _c10d.reduce_scatter_tensor.default: "reduce_scatter"}
# Ops a gradient may pass through between the mark and the collective without changing
# which element sits in which row.
_PASSTHROUGH = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clone.default,
    _aten.alias.default, _aten._to_copy.default, _aten.contiguous.default,
    torch.ops.prims.convert_element_type.default,
}
_META_KEYS = ("autograd_backward", "stack_trace", "nn_module_stack", "seq_nr", "fwd_nn_module_stack", "custom")


@dataclass
class CollectiveMatch:
    """A gradient collective fed (through `chain`) by the mark of one managed layer."""

    collective: fx.Node
    wait: fx.Node
    mark: fx.Node
    chain: list[fx.Node]
    op: str
    reduce_op: str
    group_size: int
    group_name: str

    @property
    def layer(self) -> LayerState:
        return lookup_layer(self.mark.args[2])


@dataclass
class RewriteRecord:
    fqn: str
    op: str
    shape: tuple[int, int]
    format: str
    geometry: str
    wire_bytes: int
    fp32_bytes: int


@dataclass
class RewriteReport:
    """What one run of the pass did to one graph."""

    rewritten: list[RewriteRecord] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)

    @property
    def wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.rewritten)

    @property
    def fp32_bytes(self) -> int:
        return sum(r.fp32_bytes for r in self.rewritten)


def count_ops(graph: fx.Graph) -> dict[str, int]:
    """Counts of the call_function targets that matter here (collectives, marks, matmuls)."""
    c: Counter[str] = Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            name = str(n.target)
            if "_c10d_functional" in name or "gift." in name or name in ("aten.mm.default", "aten.copy_.default"):
                c[name] += 1
    return dict(c)


def _is_mark(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is torch.ops.gift.mark.default


def _wait_of(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    if len(users) == 1 and users[0].target is _c10d.wait_tensor.default:
        return users[0]
    return None


def _trace_to_mark(n: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    chain: list[fx.Node] = []
    while isinstance(n, fx.Node) and not _is_mark(n):
        if n.op != "call_function" or n.target not in _PASSTHROUGH or len(n.users) != 1:
            return None, chain
        chain.append(n)
        n = n.args[0]
    return (n if isinstance(n, fx.Node) else None), chain


def find_gradient_collectives(graph: fx.Graph) -> list[CollectiveMatch]:
    """Every all_reduce / reduce_scatter_tensor whose input is a marked gradient."""
    matches = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _COLLECTIVES:
            continue
        mark, chain = _trace_to_mark(n.args[0])
        wait = _wait_of(n)
        if mark is None or wait is None:
            continue
        op = _COLLECTIVES[n.target]
        if op == "all_reduce":
            reduce_op, group_name = n.args[1], n.args[2]
            group_size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
        else:
            reduce_op, group_size, group_name = n.args[1], n.args[2], n.args[3]
        matches.append(CollectiveMatch(n, wait, mark, chain, op, reduce_op, group_size, group_name))
    return matches


def _fake_mode(vals: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    mode = detect_fake_mode(vals)
    if mode is None and not isinstance(V.fake_mode, torch._inductor.virtualized.NullHandler):
        mode = V.fake_mode
    return mode if mode is not None else contextlib.nullcontext()


def _replacement(match: CollectiveMatch, layer: LayerState, plan: CommPlan, out_shape: torch.Size, out_dtype: torch.dtype) -> Callable:
    n_t = len(layer.transform.tensors)
    has_residual = layer.residual is not None
    rows, cols = layer.shape
    core = gift_all_reduce if match.op == "all_reduce" else gift_reduce_scatter
    from gift_compile.api import layer_seed

    def gift_collective(grad: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        tensors = tuple(state[:n_t])
        residual = state[n_t] if has_residual else None
        probe, seed = state[-2], state[-1]
        x = grad.reshape(rows, cols)
        probe.copy_(x[: probe.shape[0]])
        out, new_residual = core(x, tensors, residual, layer_seed(layer, seed), plan)
        if residual is not None:
            residual.copy_(new_residual)
        return out.to(out_dtype).reshape(out_shape)

    return gift_collective


def _why_not(match: CollectiveMatch, layer: LayerState) -> str | None:
    grad = match.mark.args[0].meta.get("val")
    rows, cols = layer.shape
    if match.reduce_op not in ("sum", "avg"):
        return f"reduce op {match.reduce_op!r} is not a sum"
    if grad is None or grad.numel() != rows * cols:
        return "gradient shape unknown or not the weight's shape"
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"gradient dtype {grad.dtype} unsupported"
    if match.op == "reduce_scatter" and rows % match.group_size:
        return f"{rows} rows do not split evenly over {match.group_size} ranks"
    return None


def rewrite_collective(graph: fx.Graph, match: CollectiveMatch) -> RewriteRecord:
    """Replace one matched collective (+ wait) by the traced GIFT collective."""
    from torch._inductor.pattern_matcher import fwd_only

    layer = match.layer
    grad_node = match.mark.args[0]
    state_nodes = list(match.mark.args[1])
    cfg = layer.config
    spec = FormatSpec(cfg.format, cfg.scaling, cfg.block_size)
    pg = dist.distributed_c10d._resolve_process_group(match.group_name)
    plan = CommPlan(spec, layer.kind, match.group_size, dist.get_rank(pg), match.group_name,
                    match.reduce_op == "avg", cfg.stochastic_rounding)
    out_val = match.wait.meta["val"]
    fn = _replacement(match, layer, plan, out_val.shape, out_val.dtype)
    args = [grad_node, *state_nodes]
    vals = [a.meta["val"] for a in args]
    with _fake_mode(vals):
        sub = fwd_only(fn, vals, run_functional_passes=False)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    meta = {k: match.collective.meta[k] for k in _META_KEYS if k in match.collective.meta}
    with graph.inserting_before(match.wait):
        env = dict(zip(placeholders, args))
        for node in sub.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            new = graph.node_copy(node, lambda a: env[a])
            new.meta.update(meta)
            env[node] = new
        (out_node,) = torch.utils._pytree.tree_leaves(sub.graph.output_node().args[0])
        result = env[out_node]
    match.wait.replace_all_uses_with(result)
    graph.erase_node(match.wait)
    graph.erase_node(match.collective)
    for n in match.chain:
        if not n.users:
            graph.erase_node(n)
    return RewriteRecord(
        layer.fqn, match.op, layer.shape, cfg.format, cfg.geometry,
        wire_bytes_per_rank(match.op, layer.shape, spec, match.group_size),
        wire_bytes_per_rank(match.op, layer.shape, FormatSpec("fp32"), match.group_size),
    )


def _drop_marks(graph: fx.Graph, report: RewriteReport) -> None:
    """Marks left over (their gradient fed no rewritable collective) become identities."""
    for n in list(graph.nodes):
        if _is_mark(n):
            if n.users:
                fqn = lookup_layer(n.args[2]).fqn
                report.fallbacks.append((fqn, "gradient does not reach a recognised gradient collective"))
                n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)


_REPORTS: list[RewriteReport] = []


def last_reports() -> list[RewriteReport]:
    """Reports of every graph the pass has seen in this process (tests and telemetry)."""
    return list(_REPORTS)


def rewrite_gradient_collectives(gm: fx.GraphModule | fx.Graph) -> RewriteReport:
    """Entry point: rewrite every managed gradient collective of a graph, in place."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    report = RewriteReport(ops_before=count_ops(graph))
    _REPORTS.append(report)
    if not any(_is_mark(n) for n in graph.nodes):
        report.ops_after = report.ops_before
        return report
    for match in find_gradient_collectives(graph):
        reason = _why_not(match, match.layer)
        if reason is not None:
            report.fallbacks.append((match.layer.fqn, reason))
            continue
        report.rewritten.append(rewrite_collective(graph, match))
    _drop_marks(graph, report)
    graph.eliminate_dead_code()
    graph.lint()
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    report.ops_after = count_ops(graph)
    for fqn, reason in report.fallbacks:
        logger.warning("GIFT: %s stays at full precision: %s", fqn, reason)
    logger.info(
        "GIFT pass: rewrote %d gradient collectives (%d -> %d bytes per step)",
        len(report.rewritten), report.fp32_bytes, report.wire_bytes,
    )
    return report
