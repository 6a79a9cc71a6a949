"""What compiling the exchange per item (issue 31) costs in codec memory traffic.

Two ways to run one bucket's codec compiled, both measured from Inductor's generated kernels
(`bench.fidelity.overhead.generated_traffic`), in bytes per gradient element of the bucket:

- `bucket`: `bucket_core` compiled as one graph, which is what the FX pass splices into a
  training graph and what `run_bucket(compiled=True)` did before issue 31 (one compilation
  per bucket plan, i.e. per pattern of selected layers).
- `per_item`: what `run_bucket(compiled=True)` does now: each item's stages compiled alone
  (`gift_compile.exchange.compiled_bodies`), plus the eager glue between them, counted from shapes:
  the send buffer's `cat` (every block read and written once), a dense copy of each item's
  columns of the received buffer (read and written once), and for an all-reduce the same
  two copies around the all_gather. A graph of the whole bucket fuses those copies into the
  codec's kernels (except the CPU's uint8 `cat`, which it copies too: `bench.fidelity.codec_minimum`).

`python -m bench.fidelity.codec_per_item` prints one line per (bucket, op); the buckets are a single
managed item and a mixed one (a low-rank item, two identity items, a passthrough item). Then
`gated`: what carrying the selection as data in traced graphs costs one item's bucket graph.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable

import torch

from bench.fidelity.overhead import fake_group, generated_traffic, traffic_summary
from gift_compile.exchange.accounting import HEADER_BYTES
from gift_compile.exchange.bucket import _key, bucket_core
from gift_compile.exchange.item_codec import (ItemTensors, Shared, decode_stage, encode_stage, gather_decode_stage,
                                     item_width, reduce_reencode_stage)
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.geometry import Transform

Log = Callable[[str], None]


def bucket(layout: str, fmt: str, world: int, group: str | None, op: str, rank: int = 8
           ) -> tuple[BucketPlan, list[torch.Tensor], list[ItemTensors | None]]:
    """`layout` "single": one managed low-rank `[256, 512]` item; "multi": low-rank `[256, 512]`,
    identity `[256, 512]` and `[512, 256]`, and a 512-element passthrough item."""
    t = Transform("lowrank", 512, rank, seed=0)
    low = ItemPlan(name="low", rows=256, cols=512, format=fmt, kind="lowrank", n_tensors=len(t.tensors))
    items: list[tuple[ItemPlan, ItemTensors | None]] = [(low, ItemTensors(t.tensors, seed_offset=torch.tensor(1)))]
    if layout == "multi":
        items += [(ItemPlan(name="a", rows=256, cols=512, format=fmt), ItemTensors((), seed_offset=torch.tensor(2))),
                  (ItemPlan(name="b", rows=512, cols=256, format=fmt), ItemTensors((), seed_offset=torch.tensor(3))),
                  (ItemPlan.passthrough("norm", 512, torch.float32), None)]
    plan = BucketPlan(tuple(i for i, _ in items), world, group, True, op)
    xs = [torch.zeros(i.rows, i.cols) if i.managed else torch.zeros(i.numel) for i, _ in items]
    return plan, xs, [s for _, s in items]


def _codec_bytes(fn: Callable[..., object], *args: torch.Tensor) -> int:
    return sum(k.reads + k.writes for k in generated_traffic(fn, *args)[0] if not k.collective)


def measure(layout: str, fmt: str, op: str, world: int) -> dict[str, float]:
    """Bytes per gradient element of both ways for one bucket."""
    with fake_group(world) as group:
        plan, xs, states = bucket(layout, fmt, world, group, op)
        n = sum(x.numel() for x in xs)
        whole = traffic_summary(generated_traffic(lambda *g: bucket_core(list(g), states, Shared(), plan)[0], *xs)[0], n)
        shared = Shared(torch.tensor(0), torch.tensor(0), None)
        bodies = glue = 0
        send = world * HEADER_BYTES
        for x, state, item in zip(xs, states, plan.items):
            key = _key(item, state, plan)
            width = item_width(item, plan)
            cols = torch.zeros(world, width, dtype=torch.uint8)
            send += world * width
            bodies += _codec_bytes(lambda g: encode_stage(g, state, shared, key), x)
            glue += 2 * world * width  # the dense copy of the item's received columns
            if op == "reduce_scatter":
                bodies += _codec_bytes(lambda c: decode_stage(c, state, key), cols)
            else:
                bodies += _codec_bytes(lambda c: reduce_reencode_stage(c, state, shared, key), cols)
                bodies += _codec_bytes(lambda c: gather_decode_stage(c, state, key), cols)
                glue += 2 * width + 2 * world * width  # the all_gather input's cat, the gathered columns' copy
        glue += 2 * send  # the send buffer's cat
    return {"bucket": whole["bytes_per_element"], "per_item": (bodies + glue) / n, "per_item_bodies": bodies / n,
            "per_item_glue": glue / n}


def gated(fmt: str, op: str, world: int, rank: int = 8) -> dict[str, float]:
    """What the selection as data costs a traced graph (issue 31), bytes per element of one
    `[256, 512]` item's bucket graph (`bucket_core`, as the FX pass splices it): a deselected
    layer's graph before (`identity`: no map) and now (`gated_off`: the low-rank map gated off,
    which runs as the identity), a selected one's before (`lowrank`) and now (`gated_on`)."""
    t = Transform("lowrank", 512, rank, seed=0)
    base = ItemPlan(name="low", rows=256, cols=512, format=fmt)
    variants = {
        "identity": (base, ()),
        "gated_off": (replace(base, kind="lowrank", n_tensors=len(t.tensors) + 1, gated=True),
                      (*t.tensors, torch.zeros((), dtype=torch.bool))),
        "lowrank": (replace(base, kind="lowrank", n_tensors=len(t.tensors)), t.tensors),
        "gated_on": (replace(base, kind="lowrank", n_tensors=len(t.tensors) + 1, gated=True),
                     (*t.tensors, torch.ones((), dtype=torch.bool))),
    }
    out = {}
    with fake_group(world) as group:
        for name, (item, tensors) in variants.items():
            plan = BucketPlan((item,), world, group, True, op)
            state = [ItemTensors(tensors, seed_offset=torch.tensor(1))]
            x = torch.zeros(item.rows, item.cols)
            kernels = generated_traffic(lambda g: bucket_core([g], state, Shared(), plan)[0], x)[0]
            out[name] = traffic_summary(kernels, x.numel())["bytes_per_element"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.codec_per_item", description=__doc__.splitlines()[0])
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--world", type=int, default=8)
    a = p.parse_args(argv)
    for layout in ("single", "multi"):
        for op in ("reduce_scatter", "all_reduce"):
            r = measure(layout, a.format, op, a.world)
            print(f"{layout:6s} {op:14s} {a.format}: bucket graph {r['bucket']:.2f} B/el, per item "
                  f"{r['per_item']:.2f} B/el (bodies {r['per_item_bodies']:.2f} + glue {r['per_item_glue']:.2f})",
                  flush=True)
    for op in ("reduce_scatter", "all_reduce"):
        g = gated(a.format, op, a.world)
        print(f"gated  {op:14s} {a.format}: deselected layer's graph {g['identity']:.2f} -> {g['gated_off']:.2f} B/el, "
              f"selected {g['lowrank']:.2f} -> {g['gated_on']:.2f} B/el (selection as data)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
