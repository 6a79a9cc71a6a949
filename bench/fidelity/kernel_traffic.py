"""Bytes per gradient element the codec kernels move in a collective body, against the floor.

The exchange's per-item stages (`gift_compile.exchange.item_codec`: encode, then decode for a
reduce-scatter, or the decode-and-re-encode and the gather decode for an all-reduce) are traced
the way the FX pass traces them (`make_fx`) on fake CUDA tensors, so no GPU is needed: on CUDA
they emit the registered kernel operators (`torch.ops.gift_kernels.*`), and each operator's
bytes follow from its own arguments (`gift_compile.kernels.traffic`: every tensor argument read
once, the output written once). Those bytes do not depend on the torch or Inductor release that
compiles the body: that was the point of writing the kernels (issue 26).

What the kernels do not cover is listed beside them, not hidden: the maximum of the block
statistics (a reduction over one fp32 value per block, Inductor-generated; fp8's row scaling,
the bodies here, has none: one kernel chooses a row's scale and writes its codes), and the glue that
joins the item's codes, scales and header into the send buffer and slices the received one
(`bench.fidelity.codec_per_item` counts that glue for the per-item bodies). The floor is the body's
minimum (`bench.fidelity.codec_minimum.minimum_bytes`, Euclidean map, row scaling), which counts the
send and receive buffers once each.

GIFT's bodies (the low-rank map, rank 32, CUDA's `map_precision="auto"`) count the map's kernels
too, against the floor with the map (`minimum_bytes` of the low-rank kind): on the sender the
projection (`lowrank_project`) and the expansion fused into the block statistics and the encode
(`lowrank_block_stat`, `lowrank_encode`; for fp8 into the row scales and the encode,
`lowrank_fp8_scales`, `lowrank_fp8_encode`: `gift_compile.kernels.fused_sender`, the mapped
gradient never written), on the receiver the inverse map's projection and expansion (`lowrank_expand`)
after the decode; the all-reduce's gather decode expands from the gathered codes instead
(`lowrank_decode_expand`, `lowrank_fp8_decode_expand`: `gift_compile.kernels.fused_receiver`). `python -m bench.fidelity.kernel_traffic` prints one table (formats x ops x maps at
Llama shapes, 8 ranks). Each body also keeps its kernel bytes from before the fused sender
(`before_fused_sender`), carried over from the results file a run replaces, so the docs block
shows what the fusion changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from bench.fidelity.codec_minimum import minimum_bytes
from bench.lib.formatting import table
from gift_compile.exchange.item_codec import (ItemTensors, Shared, decode_stage, encode_stage, gather_decode_stage,
                                              item_width, reduce_reencode_stage)
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.geometry.maps import LowRank
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.kernels import KERNEL_FORMATS, codec_path
from gift_compile.kernels.traffic import node_traffic
from bench.lib.paths import RESULTS

SHAPES = (("600M w2", 1280, 3456), ("8B w2", 4096, 14336))
FORMATS = ("fp8_e4m3", "nvfp4", "int4", "int2")  # fp8_e4m3 with row scaling: GiftConfig's default
OPS = ("reduce_scatter", "all_reduce")
WORLD = 8
RANK = 32  # GIFT's bodies: the low-rank map at the default rank
GOAL = 1.3  # every body within this factor of its floor (the GPU-speed issue's byte goal)
OUT = RESULTS / "fidelity" / "kernel_traffic.json"
# a body's kernel bytes per element before GIFT's sender was fused (issue 26), kept across runs
BEFORE = "before_fused_sender"
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _fake_cuda(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor on `cuda`: metadata only, so CUDA's choices are traced on any machine."""
    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda"))


def _lowrank_tensors(mode: FakeTensorMode, cols: int, rank: int) -> tuple[torch.Tensor, ...]:
    """A low-rank map's tensors (`LowRank`: D^-1/2, V, C, C', D^1/2) as fake CUDA tensors."""
    return tuple(_fake_cuda(mode, shape, torch.float32) for shape in ((cols,), (cols, rank), (rank,), (rank,), (cols,)))


def stages(fmt: str, op: str, rows: int, cols: int, world: int, mode: FakeTensorMode, rank: int = 0
           ) -> list[tuple[str, Callable[[torch.Tensor], object], tuple[int, ...], torch.dtype]]:
    """The per-item stages of one `[rows, cols]` item on a `world`-rank `op` plan, each with the
    shape and dtype of its input (the gradient, or the received `[world, width]` bytes):
    Euclidean, or with `rank` > 0 GIFT's rank-`rank` low-rank map at `map_precision="auto"`
    (the tensor-core kernels on CUDA)."""
    item = ItemPlan(name="g", rows=rows, cols=cols, format=fmt, scaling="row", block_size=32,
                    kind=LowRank.kind if rank else IDENTITY_KIND, n_tensors=5 if rank else 0)
    plan = BucketPlan((item,), world, None, False, op)
    state, shared = ItemTensors(_lowrank_tensors(mode, cols, rank) if rank else ()), Shared()
    width = (world, item_width(item, plan))
    out = [("encode", lambda g: encode_stage(g, state, shared, plan), (rows, cols), torch.float32)]
    if op == "reduce_scatter":
        out.append(("decode", lambda c: decode_stage(c, state, plan), width, torch.uint8))
    else:
        out.append(("reduce + re-encode", lambda c: reduce_reencode_stage(c, state, shared, plan), width, torch.uint8))
        out.append(("gather decode", lambda c: gather_decode_stage(c, state, plan), width, torch.uint8))
    return out


def measure(fmt: str, op: str, rows: int, cols: int, world: int = WORLD, rank: int = 0) -> dict[str, object]:
    """Kernel bytes per gradient element of one body (Euclidean, or GIFT's rank-`rank` low-rank
    map), kernel by kernel, and the floor. A traced stage that still holds a matmul outside
    the kernels (the map's on CUDA must not) raises: its bytes would be missing here."""
    if not codec_path(ItemPlan(name="g", rows=rows, cols=cols, format=fmt, block_size=32).spec,
                      torch.device("cuda")).kernels:
        raise ValueError(f"kernel_traffic: format {fmt!r} has no kernels on CUDA (they exist for "
                         f"{', '.join(KERNEL_FORMATS)}), or they are switched off")
    n = rows * cols
    kernels = []
    mode = FakeTensorMode()
    for stage, fn, shape, dtype in stages(fmt, op, rows, cols, world, mode, rank):
        with mode:
            gm = make_fx(fn)(_fake_cuda(mode, shape, dtype))
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in _MATMULS:
                raise RuntimeError(f"kernel_traffic: the {stage} stage traced {node.target} outside the codec's kernels")
            t = node_traffic(node)
            if t is not None:
                kernels.append({"stage": stage, "kernel": t.op, "reads_per_element": t.reads / n,
                                "writes_per_element": t.writes / n})
    total = sum(k["reads_per_element"] + k["writes_per_element"] for k in kernels)
    kind = LowRank.kind if rank else IDENTITY_KIND
    floor = minimum_bytes(op, fmt, "row", kind, rows, cols, rank, world)["total"]
    return {"format": fmt, "op": op, "map": kind, "rank": rank, "rows": rows, "cols": cols, "world": world,
            "kernels": kernels, "kernel_bytes_per_element": total, "floor_bytes_per_element": floor,
            "kernel_over_floor": total / floor}


def render(results: list[dict[str, object]]) -> str:
    """The per-body table and the per-kernel one, as Markdown."""
    per_kernel = [[f"{r['rows']}x{r['cols']}", r["format"], r["op"], r["map"], k["stage"], k["kernel"],
                   k["reads_per_element"], k["writes_per_element"]] for r in results for k in r["kernels"]]
    return "\n".join([
        body_table(results), "",
        table(["gradient", "format", "op", "map", "stage", "kernel", "reads B/el", "writes B/el"], per_kernel, 4)])


def body_table(results: list[dict[str, object]]) -> str:
    """One row per body: its kernel bytes, its floor and their ratio, and (where the results
    carry them) its kernel bytes and ratio before the fused sender (Markdown)."""
    before = all(BEFORE in r for r in results)
    rows = [[f"{r['rows']}x{r['cols']}", r["format"], r["op"], r["map"], r["kernel_bytes_per_element"],
             r["floor_bytes_per_element"], r["kernel_over_floor"],
             *((r[BEFORE], r[BEFORE] / r["floor_bytes_per_element"]) if before else ())] for r in results]
    head = ["gradient", "format", "op", "map", "kernels B/el", "floor B/el", "kernels / floor"]
    return table(head + (["before: kernels B/el", "before: / floor"] if before else []), rows, 3)


def carry_before(results: list[dict[str, object]], previous: Path) -> None:
    """Give each body its kernel bytes before the fused sender (`BEFORE`), from the results file
    this run replaces: its `BEFORE` where it has one, else (a file written before the fusion)
    its kernel bytes. A body the previous file lacks gets none, and then no body shows one."""
    if not previous.exists():
        return
    old = {_key(r): r.get(BEFORE, r["kernel_bytes_per_element"]) for r in json.loads(previous.read_text())["results"]}
    for r in results:
        if _key(r) in old:
            r[BEFORE] = old[_key(r)]


def _key(r: dict[str, object]) -> tuple[object, ...]:
    return r["rows"], r["cols"], r["format"], r["op"], r["map"], r["rank"], r["world"]


def block(_: dict | None = None, path: Path = OUT) -> str:
    """The docs/benchmarks.md block: each body's kernel bytes against its floor, from the
    results file, with which bodies are within `GOAL` of their floor computed from it."""
    d = json.loads(path.read_text())
    worst = {m: max(r["kernel_over_floor"] for r in d["results"] if r["map"] == m)
             for m in dict.fromkeys(r["map"] for r in d["results"])}
    verdict = "; ".join(f"{m} bodies at most {w:.2f}x their floor ({'within' if w <= GOAL else 'above'} {GOAL}x)"
                        for m, w in worst.items())
    return "\n".join([
        f"Bytes per gradient element the explicit codec kernels move in each {d['world']}-rank collective body "
        f"(`{d['command']}` -> [bench/results/fidelity/kernel_traffic.json](../bench/results/fidelity/kernel_traffic.json); from the "
        "kernels' arguments on fake CUDA tensors, so the same under every torch release; GIFT's bodies with the "
        f"rank-{d['rank']} low-rank map's two kernels on each side; not counted: Inductor's glue around the kernels, "
        "the block statistics' maximum and the send-buffer joins), against the body's floor "
        "(`bench.fidelity.codec_minimum.minimum_bytes`):", "",
        body_table(d["results"]), "",
        f"{verdict}. GIFT's sender computes the map's expansion inside the block statistics and the encode "
        "(`gift_compile.kernels.fused_sender`) instead of writing the mapped gradient and reading it back twice; "
        "the `before` columns are each body's kernel bytes with that unfused chain (fp8_e4m3's sender, fused "
        "into the row scales and the encode, `lowrank_fp8_scales` and `lowrank_fp8_encode`, included). The "
        "two-level formats' sender now reads the gradient three times (projection, statistics, encode), as their "
        "floor does; fp8's sender reads it three times too (projection, row scales, encode), where the floor's "
        "row-scaled sender reads it twice: its scale and encode share one pass over a row, which a kernel that "
        "recomputes the expansion tile by tile could only match by walking a row block's tiles twice and relying "
        "on the cache to serve the second walk (`[64, cols]` fp32: MBs at these widths). The all-reduce's "
        "receiver decodes the gathered codes a second time inside the inverse map's expansion "
        "(`gift_compile.kernels.fused_receiver`: `lowrank_decode_expand`, `lowrank_fp8_decode_expand`) instead of "
        "reading the decoded fp32 result back, as the floor's receiver does; the `before` columns predate that "
        "too. What keeps fp8's all-reduce bodies above the two-level formats' ratio is the same second read of "
        "the gradient on the sender."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.kernel_traffic", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=WORLD)
    p.add_argument("--out", type=Path, default=OUT, help="the results JSON (the docs block reads the default)")
    a = p.parse_args(argv)
    results = [measure(fmt, op, r, c, a.world, rank) for _, r, c in SHAPES for fmt in FORMATS for op in OPS
               for rank in (0, RANK)]
    carry_before(results, a.out)
    command = "python -m bench.fidelity.kernel_traffic" + (f" --world {a.world}" if a.world != WORLD else "")
    a.out.write_text(json.dumps({"command": command, "world": a.world, "rank": RANK, "results": results}, indent=1)
                     + "\n")
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
