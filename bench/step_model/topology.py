"""Step time per gradient exchange on a multi-node cluster, with the network as it is laid out.

`python -m bench.step_model.topology` writes `bench/results/step_model/topology_model.json` and
`bench/results/step_model/topology_model.png`, which the `topology_model` block of docs/benchmarks.md and
the `when_it_pays` block of README.md render (`bench.pages.readme`).

Why this model: `bench.step_model.gpu` prices every arm's bytes over one link rate per GPU,
which credits neither NCCL's ring (it crosses each node boundary about once per channel and
spreads channels over the node's NICs) nor the all-to-all's limit (each GPU's bytes leave through
its own NIC). Here each collective is priced where its bytes go, for flat FSDP over `nodes x g`
GPUs (torchtitan's `dp_shard = -1`; the gradient reduce-scatter of one step):

- fp32 / bf16 ring reduce-scatter: `S (W-1)/W / busbw`, the ring's bus bandwidth per node
  count: the node's network rate times the ring efficiency of `INPUTS` (anchored at 4, 64 and
  128 nodes, interpolated in log2 of the node count), capped by NVLink's;
- a flat all-to-all (Euclidean low-bit, GIFT one level): the bytes each GPU hands over
  (`bucket_wire_bytes`), the share `(W-g)/W` for other nodes at its own NIC's rate (the node's
  rate / g, times the all-to-all efficiency), the rest over NVLink, whichever is slower;
- GIFT two levels (`gift_compile.exchange.node_stage`): the node's reduce-scatter of the fp32
  gradient at NVLink's reduce-scatter bus bandwidth (its bytes `bucket_hop_bytes`, inside:
  at fp32, or at bf16 under `GiftConfig.intra_node_format="bf16"`, the arm "GIFT two-level,
  bf16 in node"), then stage 2's bytes (`bucket_hop_bytes`, across) at the NIC rate, `(n-1)/n`
  of them leaving the node;
- HSDP with GIFT on the replica hop: the same node reduce-scatter, then GIFT's all-reduce of
  the 1/g shard over the n replicas (its all_to_all `(n-1)/n` and its all_gather `n-1` shards
  over the NIC), at the cost of a model replica per node.

Compute is the measured H200 bf16 GEMMs (`bench.step_model.pricing.GemmPricer`, forward and both
backward GEMMs of every linear at 8192 tokens per GPU); the codec is the measured H200 codec
body (`CodecPricer`: its one-rank all-reduce body, an upper bound for a reduce-scatter's) at
each stage's element count: the whole gradient for a flat exchange, the node's chunk (rows / g)
for two levels and HSDP; GIFT's statistics and refresh are priced as in `bench.step_model.gpu`.
Nothing overlaps (every byte exposed): the setting most favourable to compression. Each input
is marked measured (a committed file) or assumed (`INPUTS`: the public figure it stands for).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.step_model.pricing import GEMM_TOKENS, PATHS, CodecPricer, GemmPricer, load_bodies, load_gemms
from bench.step_model.cpu import StepModelInputs, arm_layers
from bench.lib.wire import MODEL_CONFIGS, meta_model
from gift_compile.config import GiftConfig
from gift_compile.exchange.accounting import bucket_hop_bytes, bucket_wire_bytes
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.exchange.topology import FLAT, NodeLayout
from bench.lib.paths import RESULTS

OUT = RESULTS / "step_model" / "topology_model.json"
PLOT = RESULTS / "step_model" / "topology_model.png"
COMMAND = "python -m bench.step_model.topology"
MODELS = ("Llama-3-8B", "Llama-3-70B")
FORMATS = {"fp8": dict(format="fp8_e4m3", scaling="row"), "nvfp4": dict(format="nvfp4", scaling="row")}
GPUS_PER_NODE = 8
TWO_LEVEL_BF16 = "GIFT two-level, bf16 in node"
ARM_NAMES = ("fp32 ring", "bf16 ring", "Euclidean flat", "GIFT flat", "GIFT two-level", TWO_LEVEL_BF16,
             "HSDP + GIFT replica hop")
GIFT_ARMS = ("GIFT flat", "GIFT two-level", TWO_LEVEL_BF16, "HSDP + GIFT replica hop")


@dataclass(frozen=True)
class Input:
    """One number of the model: its value and where it comes from."""

    value: float
    kind: str  # "assumed" (a public figure, not measured here) or "measured" (a committed file)
    source: str


INPUTS: dict[str, Input] = {
    "ring_eff_4": Input(0.90, "assumed", "NCCL ring reduce-scatter bus bandwidth, H100, 400 Gb/s per GPU: ~360 GB/s of "
                                         "the node's 400 GB/s at 4 nodes (NCCL GitHub issue #1229)"),
    "ring_eff_64": Input(0.70, "assumed", "the same at 64 nodes: ~280 GB/s (NCCL issue #1229)"),
    "ring_eff_128": Input(0.65, "assumed", "the same at 128 nodes: ~260 GB/s (NCCL issue #1229)"),
    "a2a_eff": Input(0.94, "assumed", "all-to-all bound by one NIC per GPU: ~46-48 GB/s of a 50 GB/s NIC "
                                      "(nccl-tests issues #290, #267)"),
    "nvlink_busbw": Input(360.0, "assumed", "GB/s: NCCL reduce-scatter bus bandwidth inside one 8-GPU NVLink4 node "
                                            "(nccl-tests on H100 SXM, a round figure below the 450 GB/s per direction)"),
    "nvlink_gpu": Input(360.0, "assumed", "GB/s per GPU for an all-to-all's intra-node share (NVLink4, as above)"),
    "gpus_per_node": Input(GPUS_PER_NODE, "assumed", "HGX H100/H200 node"),
    "tokens_per_gpu": Input(GEMM_TOKENS, "measured", "the token count of the measured GEMMs "
                                                     "(bench/results/gpu/gpu_h200/gpu_lowrank_alt.json)"),
}


@dataclass(frozen=True)
class Regime:
    """A cluster network: the node's network rate (GB/s, all its NICs) and the node counts."""

    name: str
    node_gbytes: float
    nodes: tuple[int, ...]
    source: str


REGIMES = (
    Regime("InfiniBand 400 Gb/s per GPU", 8 * 50.0, (8, 16, 32, 64, 128), "assumed: NDR, one NIC per GPU"),
    Regime("RoCE 100 GbE per node", 12.5, (8, 64), "assumed: one 100 GbE NIC per node"),
    Regime("25 GbE per node", 3.125, (8, 64), "assumed: one 25 GbE NIC per node"),
    Regime("cross-site 10 Gb/s link", 1.25, (2,), "assumed: two sites of one node each over a 10 Gb/s replica link"),
)


def ring_efficiency(nodes: int) -> float:
    """The ring's share of the node's network rate at `nodes` nodes: the anchors of `INPUTS`,
    linear in log2(nodes) between them, held flat outside."""
    anchors = [(4, INPUTS["ring_eff_4"].value), (64, INPUTS["ring_eff_64"].value), (128, INPUTS["ring_eff_128"].value)]
    if nodes <= anchors[0][0]:
        return anchors[0][1]
    for (n0, e0), (n1, e1) in zip(anchors, anchors[1:]):
        if nodes <= n1:
            t = (math.log2(nodes) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return e0 + t * (e1 - e0)
    return anchors[-1][1]


def _padded(rows: int, world: int) -> int:
    return -(-rows // world) * world  # FSDP2 pads dim 0 to the world size


@dataclass(frozen=True)
class Layer:
    rows: int
    cols: int
    count: int


@functools.cache
def _layers(model: str) -> tuple[list[Layer], int, int]:
    """The model's managed linear shapes (with counts), its unmanaged parameter count and all."""
    cfg = MODEL_CONFIGS[model]
    zero = lambda plan, r: 0.0  # noqa: E731 -- bytes come from the accounting, the codec from the GPU
    costs = arm_layers(GiftConfig(format="fp8_e4m3", geometry="none"), cfg, StepModelInputs(gpus=64), zero)
    counts: dict[tuple[int, int], int] = {}
    for c in costs:
        counts[c.rows, c.cols] = counts.get((c.rows, c.cols), 0) + 1
    params = sum(p.numel() for p in meta_model(cfg).parameters())
    managed = sum(c.rows * c.cols for c in costs)
    return [Layer(r, c, n) for (r, c), n in counts.items()], params - managed, params


@functools.cache
def _gift_flops(model: str, fmt: str) -> tuple[float, float]:
    """GIFT's statistics µs per step and its refresh µs per step on one rank (the low-rank map at
    r = 32 on every layer), as `bench.step_model.gpu` prices them (its assumed fp32 and refresh
    rates); the refresh is sharded over the ranks (`_gift_extra_us`)."""
    x = StepModelInputs(gpus=1, tokens_per_gpu=GEMM_TOKENS)
    zero = lambda plan, r: 0.0  # noqa: E731
    gift = arm_layers(GiftConfig(**FORMATS[fmt], geometry="lowrank", select="all"), MODEL_CONFIGS[model], x, zero)
    fp32_rate, refresh_rate = x.fp32_tflops * x.fp32_efficiency * 1e6, x.refresh_tflops * 1e6
    return sum(c.stats_flops for c in gift) / fp32_rate, sum(c.refresh_flops for c in gift) / refresh_rate


def _gift_extra_us(model: str, fmt: str, nodes: int) -> float:
    """GIFT's statistics and refresh per step on each of `nodes` x 8 ranks."""
    stats, refresh = _gift_flops(model, fmt)
    return stats + refresh / (nodes * GPUS_PER_NODE)


def price(model: str, fmt: str, nodes: int, node_gbytes: float, codec: CodecPricer, gemm: GemmPricer,
          layers: tuple[list[Layer], int, int], gift_extra: float) -> dict[str, dict[str, float]]:
    """Per arm `{"compute", "comm", "codec", "step"}` in µs for one step of `model` on `nodes`
    nodes of 8 GPUs whose network carries `node_gbytes` GB/s per node."""
    shapes, unmanaged, params = layers
    g = GPUS_PER_NODE
    world = nodes * g
    compute = sum(s.count * gemm.price(s.rows, s.cols, GEMM_TOKENS).total_us for s in shapes)
    cfg = MODEL_CONFIGS[model]
    compute += gemm.price(cfg.vocab_size, cfg.dim, GEMM_TOKENS).total_us  # the output layer
    nic = node_gbytes / g * INPUTS["a2a_eff"].value * 1e3  # bytes per µs per GPU, across nodes
    nvl_rs, nvl_gpu = INPUTS["nvlink_busbw"].value * 1e3, INPUTS["nvlink_gpu"].value * 1e3
    ring_bw = min(node_gbytes * ring_efficiency(nodes), INPUTS["nvlink_busbw"].value) * 1e3
    grad32 = 4.0 * params
    out: dict[str, dict[str, float]] = {}
    for name, per_elem in (("fp32 ring", 4.0), ("bf16 ring", 2.0)):
        out[name] = {"compute": compute, "comm": per_elem * params * (world - 1) / world / ring_bw, "codec": 0.0}
    spec = FORMATS[fmt]
    layout = NodeLayout(g, nodes, "node", "cross")
    layout16 = layout.with_node_format("bf16")
    flat_wire = two_cross = hsdp_net = node32 = node16 = 0.0
    codec_flat = {"euclid": 0.0, "gift": 0.0}
    codec_chunk = 0.0
    for s in shapes:
        item = ItemPlan(name="w", rows=_padded(s.rows, world), cols=s.cols, **spec)
        flat_wire += s.count * bucket_wire_bytes(BucketPlan((item,), world, "g", False, "reduce_scatter", FLAT))
        node, cross = bucket_hop_bytes(BucketPlan((item,), world, "g", False, "reduce_scatter", layout))
        two_cross += s.count * cross
        node32 += s.count * node
        node16 += s.count * bucket_hop_bytes(BucketPlan((item,), world, "g", False, "reduce_scatter", layout16))[0]
        shard = ItemPlan(name="w", rows=_padded(-(-s.rows // g), nodes), cols=s.cols, **spec)
        a2a = bucket_wire_bytes(BucketPlan((shard,), nodes, "r", False, "reduce_scatter"))
        total = bucket_wire_bytes(BucketPlan((shard,), nodes, "r", False, "all_reduce"))
        hsdp_net += s.count * (a2a * (nodes - 1) / nodes + (total - a2a) * (nodes - 1))
        for arm, kind in (("euclid", "identity"), ("gift", "lowrank")):
            codec_flat[arm] += s.count * codec.price(PATHS[(kind, spec["format"])], s.rows, s.cols).device_us
        codec_chunk += s.count * codec.price(PATHS[("lowrank", spec["format"])], max(1, item.rows // g), s.cols).device_us
    # the unmanaged parameters travel raw (fp32) in the same exchanges (bf16 inside the node under bf16)
    flat_wire += 4.0 * unmanaged
    node32 += 4.0 * unmanaged
    node16 += 2.0 * unmanaged
    two_cross += 4.0 * unmanaged / g
    hsdp_net += 4.0 * unmanaged / g * 2 * (nodes - 1) / nodes
    flat_comm = max(flat_wire * (world - g) / world / nic, flat_wire * (g - 1) / world / nvl_gpu)
    node_rs = node32 * (g - 1) / g / nvl_rs
    node_rs16 = node16 * (g - 1) / g / nvl_rs
    out["Euclidean flat"] = {"compute": compute, "comm": flat_comm, "codec": codec_flat["euclid"]}
    out["GIFT flat"] = {"compute": compute, "comm": flat_comm, "codec": codec_flat["gift"] + gift_extra}
    cross = two_cross * (nodes - 1) / nodes / nic
    out["GIFT two-level"] = {"compute": compute, "comm": node_rs + cross, "codec": codec_chunk + gift_extra}
    out[TWO_LEVEL_BF16] = {"compute": compute, "comm": node_rs16 + cross, "codec": codec_chunk + gift_extra}
    out["HSDP + GIFT replica hop"] = {"compute": compute, "comm": grad32 * (g - 1) / g / nvl_rs + hsdp_net / nic,
                                      "codec": codec_chunk + gift_extra}
    for v in out.values():
        v["step"] = v["compute"] + v["comm"] + v["codec"]
    return out


def run() -> dict[str, object]:
    codec, gemm = CodecPricer(load_bodies()), GemmPricer(load_gemms())
    rows = []
    for model in MODELS:
        layers = _layers(model)
        for regime in REGIMES:
            for nodes in regime.nodes:
                for fmt in FORMATS:
                    extra = _gift_extra_us(model, fmt, nodes)
                    arms = price(model, fmt, nodes, regime.node_gbytes, codec, gemm, layers, extra)
                    rows.append({"model": model, "regime": regime.name, "nodes": nodes, "format": fmt,
                                 "gbytes_per_gpu": regime.node_gbytes / GPUS_PER_NODE, "arms": arms})
    sweep = []
    for model in MODELS:
        layers = _layers(model)
        extra = _gift_extra_us(model, "nvfp4", 64)
        for i in range(37):
            per_gpu = 0.1 * 10 ** (i / 12)  # 0.1 to 100 GB/s per GPU
            arms = price(model, "nvfp4", 64, per_gpu * GPUS_PER_NODE, codec, gemm, layers, extra)
            sweep.append({"model": model, "gbytes_per_gpu": per_gpu, "step_ms": {a: v["step"] / 1e3 for a, v in arms.items()}})
    return {"command": COMMAND, "inputs": {k: vars(v) for k, v in INPUTS.items()},
            "regimes": [vars(r) | {"nodes": list(r.nodes)} for r in REGIMES], "rows": rows, "sweep": sweep,
            "measured": {"codec": "bench/results/gpu/gpu_h200/gpu_check_codec.json",
                         "gemm": "bench/results/gpu/gpu_h200/gpu_lowrank_alt.json"}}


def plot(d: dict, out: Path = PLOT) -> None:
    """Step time against network bandwidth per GPU at 64 nodes, NVFP4, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 4.2))
    for ax, model in zip(axes, MODELS):
        pts = [s for s in d["sweep"] if s["model"] == model]
        for arm in ARM_NAMES:
            ax.plot([p["gbytes_per_gpu"] for p in pts], [p["step_ms"][arm] / 1e3 for p in pts], label=arm)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("network GB/s per GPU (64 nodes x 8, NVFP4 for the low-bit arms)")
        ax.set_ylabel("step time, s (nothing overlapped)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _best_gift(arms: dict) -> tuple[str, float]:
    name = min(GIFT_ARMS, key=lambda a: arms[a]["step"])
    return name, arms[name]["step"]


def block(_: dict | None = None, path: Path = OUT) -> str:
    """The docs/benchmarks.md block: step time per arm, regime, node count and model."""
    d = json.loads(path.read_text())
    head = ["model", "network", "nodes", "format", *ARM_NAMES, "two-level vs bf16 ring",
            "two-level, bf16 in node, vs bf16 ring"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in d["rows"]:
        a = r["arms"]
        vs = [a[arm]["step"] / a["bf16 ring"]["step"] - 1 for arm in ("GIFT two-level", TWO_LEVEL_BF16)]
        lines.append("| " + " | ".join([r["model"], r["regime"], str(r["nodes"]), r["format"],
                                         *(f"{a[n]['step'] / 1e3:.0f}" for n in ARM_NAMES),
                                         *(f"{v:+.1%}" for v in vs)]) + " |")
    inputs = "; ".join(f"{k} = {v['value']:g} ({v['kind']})" for k, v in d["inputs"].items())
    return "\n".join([
        "Step time in ms per optimizer step (flat FSDP's gradient reduce-scatter plus the GEMMs and GIFT's codec, "
        "nothing overlapped), by where each collective's bytes go (`bench/step_model/topology.py`: the rule, and the public "
        "figure each assumed input stands for). Compute and codec from the H200 measurement, the codec at each stage's "
        "element count (the node's 1/g chunk for two levels and HSDP). \"bf16 in node\": the same two levels with "
        "`GiftConfig.intra_node_format=\"bf16\"` (the node's reduce-scatter at half the bytes; stage 2 unchanged).",
        "", *lines, "",
        f"Inputs: {inputs}. Plot: [bench/results/step_model/topology_model.png](../bench/results/step_model/topology_model.png). "
        f"Regenerate: `{d['command']}` then `python -m bench.pages.readme`."])


def when_it_pays(_: dict | None = None, path: Path = OUT) -> str:
    """The README block: per model and network, GIFT's best arm against the bf16 ring per step
    (its range over the node counts and formats modelled), split into where it pays and not."""
    d = json.loads(path.read_text())
    groups: dict[tuple[str, str], list[tuple[float, str, int, str]]] = {}
    for r in d["rows"]:
        name, best = _best_gift(r["arms"])
        groups.setdefault((r["model"], r["regime"]), []).append(
            (best / r["arms"]["bf16 ring"]["step"] - 1, name, r["nodes"], r["format"]))
    pays, mixed, not_pays = [], [], []
    for (model, regime), vs in groups.items():
        lo, hi = min(vs), max(vs)
        arms = sorted({name for _, name, _, _ in vs})
        nodes = sorted({n for _, _, n, _ in vs})
        text = (f"{model} on {regime} ({'/'.join(map(str, nodes))} nodes x 8): {' or '.join(arms)} "
                f"{lo[0]:+.0%} to {hi[0]:+.0%} per step")
        (pays if hi[0] < 0 else not_pays if lo[0] >= 0 else mixed).append(text)
    return "\n".join([
        "A step model that prices each collective where its bytes go (ring and all-to-all rates are public "
        "figures, marked assumed; compute and codec are the H200 measurement; every byte exposed, nothing "
        "overlapped): GIFT's best arm (flat, two-level with the node's reduce-scatter at fp32 or at bf16 "
        "(`GiftConfig.intra_node_format`), or HSDP with GIFT on the replica hop) against the bf16 ring "
        "reduce-scatter, fp8 and NVFP4:", "",
        *(f"* pays: {t}." for t in pays), *(f"* pays at some node counts or formats: {t}." for t in mixed),
        *(f"* does not pay: {t}." for t in not_pays), "",
        f"Per arm, node count and format: [docs/benchmarks.md](docs/benchmarks.md#step-time-by-topology); plot "
        f"[bench/results/step_model/topology_model.png](bench/results/step_model/topology_model.png); `{d['command']} && python -m bench.pages.readme`."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    d = run()
    a.out.write_text(json.dumps(d, indent=1) + "\n")
    plot(d)
    print(block(path=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
