"""Step-time projection of flat FSDP vs HSDP, with one precision or a precision per hop.

8 nodes x 8 GPUs: NVLink inside a node, one 400 Gb/s-class NIC per GPU across nodes. Flat FSDP
reduce-scatters every gradient over all 64 ranks, so every byte crosses the network. HSDP
(`gift_compile.frameworks.hsdp`) reduce-scatters over the 8 GPUs of a node (NVLink) at `format`, then each
GPU all-reduces its 1/8 shard with its peers in the 7 other nodes (network) at
`replica_format`. Per arm and model::

    step = compute + exposed * (network comm + NVLink comm) + codec + statistics + refresh

Every input is labelled in `SOURCES`: *assumed* (hardware rates and efficiencies, from
datasheets or common practice), *measured* (bytes per gradient element of GIFT's codec,
read from the generated kernels of the all-reduce plans by `bench.step_model.cpu` and stored in
bench/results/results.json; the same figure prices a reduce-scatter's codec, an upper bound
since it skips the re-encode and the full decode) or *calibrated* (the exposed share of
communication that reproduces the paper's Euclidean FP8 result, `bench.step_model.cpu`). Bytes on
each hop are `gift_compile.exchange.collectives.bucket_wire_bytes` of the plans GIFT runs, the accounting
the 4-rank HSDP tests check against the bytes counted at run time. Statistics and refresh costs
come from `bench.step_model.cpu.arm_layers` (a meta-device `GiftState` of the model).

    python -m bench.step_model.hsdp            # prints the table, writes bench/results/step_model/hsdp_step_model.json

Its flat-FSDP arm sends every byte of an all-to-all over the network and does not credit
NCCL's ring, and it predates the two-level exchange (`GiftConfig.ranks_per_node`): the step
model that prices rings, all-to-alls and NVLink where their bytes go, with GIFT's two levels
as an arm, is `bench.step_model.topology`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from bench.step_model.cpu import StepModelInputs, arm_layers
from bench.lib.wire import MODEL_CONFIGS, meta_model
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import bucket_wire_bytes
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from bench.lib.paths import RESULTS


SOURCES = {
    "nodes, gpus_per_node": "assumed: 8 x 8 GPUs",
    "peak_tflops, mfu, tokens_per_gpu, hbm_tbytes, kernel_efficiency, fp32_tflops": "assumed (bench.step_model.cpu defaults)",
    "link_gbytes, link_efficiency": "assumed: 400 Gb/s NIC per GPU = 50 GB/s at 80% (bench.step_model.cpu defaults)",
    "nvlink_gbytes, nvlink_efficiency": "assumed: H100 NVLink4 450 GB/s per direction at 80%",
    "exposed_fraction": "calibrated: bench.step_model.cpu's share that reproduces the paper's Euclidean FP8 -10.8%",
    "codec bytes per element": "measured: generated kernels of the all-reduce codec (bench/results/results.json)",
    "flat FSDP network bytes": "assumed: each GPU's reduce-scatter traffic ((P-1)/P of its buffer) crosses its NIC, "
                               "the step model's rule; a topology-aware ring that keeps part of it on NVLink is not credited",
    "bytes per hop": "computed: bucket_wire_bytes of the plans GIFT runs (the accounting the tests check against counted bytes)",
}


@dataclass(frozen=True)
class HsdpInputs:
    """Topology and link assumptions on top of `StepModelInputs` (which sets gpus = 64)."""

    nodes: int = 8
    gpus_per_node: int = 8
    nvlink_gbytes: float = 450.0
    nvlink_efficiency: float = 0.80


# arm -> (layout, shard-hop / flat config, replica format); None config = plain fp32 collectives
_EUC, _GIFT = dict(geometry="none"), dict(geometry="lowrank", select="all")
_FP8 = dict(format="fp8_e5m2", scaling="tensor")  # the measured fp8 codec (the paper's wire format)
ARMS: dict[str, tuple[str, GiftConfig | None]] = {
    "FSDP fp32": ("flat", None),
    "FSDP fp8": ("flat", GiftConfig(**_FP8, **_EUC)),
    "FSDP gift-nvfp4": ("flat", GiftConfig(format="nvfp4", **_GIFT)),
    "HSDP fp32": ("hsdp", None),
    "HSDP fp8 / fp8": ("hsdp", GiftConfig(**_FP8, **_EUC)),
    "HSDP gift-nvfp4 / nvfp4": ("hsdp", GiftConfig(format="nvfp4", **_GIFT)),
    "HSDP fp32 / nvfp4": ("hsdp", GiftConfig(format="fp32", replica_format="nvfp4", **_EUC)),
    "HSDP fp8 / nvfp4": ("hsdp", GiftConfig(**_FP8, replica_format="nvfp4", **_EUC)),
    "HSDP fp32 / gift-nvfp4": ("hsdp", GiftConfig(format="fp32", replica_format="nvfp4", **_GIFT)),
    "HSDP bf16 / gift-nvfp4": ("hsdp", GiftConfig(format="bf16", replica_format="nvfp4", **_GIFT)),
    "HSDP fp8 / gift-nvfp4": ("hsdp", GiftConfig(**_FP8, replica_format="nvfp4", **_GIFT)),
}


def measured_codec(results: dict) -> Callable[[ItemPlan, int], float]:
    """Codec bytes per element by (format, scaling, kind), from the stored measurements (mean
    over the measured shapes); raises for a codec that was not measured."""
    table: dict[tuple[str, str, str], list[float]] = {}
    for m in results["step_model"]["codec_measured"]:
        table.setdefault((m["format"], m["scaling"], m["kind"]), []).append(m["bytes_per_element"])

    def lookup(plan: ItemPlan, rank: int) -> float:
        if plan.format == "fp32":
            return 0.0  # no codec (a transform, if any, is priced by its FLOPs)
        # bf16 is a cast: its measured identity codec, the transform priced by its FLOPs
        # block formats ignore `scaling` (the measurements were taken with the default "row")
        scaling = plan.scaling if plan.format in ("fp8_e4m3", "fp8_e5m2") else "row"
        key = (plan.format, scaling, "identity" if plan.format == "bf16" else plan.kind)
        if key not in table:
            raise KeyError(f"hsdp_model: no measured codec for {key}; measured: {sorted(table)}")
        return sum(table[key]) / len(table[key])

    return lookup


def _rs_sent(item: ItemPlan, world: int) -> float:
    """Bytes one rank transmits in a reduce-scatter of `item` over `world` ranks."""
    return (world - 1) / world * bucket_wire_bytes(BucketPlan((item,), world, "g", False, "reduce_scatter"))


def _ar_sent(item: ItemPlan, world: int) -> float:
    """Bytes one rank transmits in GIFT's all-reduce (all_to_all + all_gather) of `item`."""
    padded = dataclasses.replace(item, rows=item.rows + (-item.rows) % world)
    a2a = bucket_wire_bytes(BucketPlan((padded,), world, "g", False, "reduce_scatter"))
    total = bucket_wire_bytes(BucketPlan((padded,), world, "g", False, "all_reduce"))
    return (world - 1) / world * a2a + (world - 1) * (total - a2a)


def project_arm(layout: str, config: GiftConfig | None, model_name: str, x: StepModelInputs, h: HsdpInputs,
                codec: Callable[[ItemPlan, int], float]) -> dict[str, float]:
    """Step-time breakdown (seconds) of one arm."""
    model_config = MODEL_CONFIGS[model_name]
    params = sum(p.numel() for p in meta_model(model_config).parameters())
    compute = 6.0 * params * x.tokens_per_gpu / (x.peak_tflops * 1e12 * x.mfu)
    net = x.link_gbytes * 1e9 * x.link_efficiency
    nvl = h.nvlink_gbytes * 1e9 * h.nvlink_efficiency
    hbm = x.hbm_tbytes * 1e12 * x.kernel_efficiency
    fp32_rate = x.fp32_tflops * 1e12 * x.fp32_efficiency
    g, n, p = h.gpus_per_node, h.nodes, x.gpus
    layers = arm_layers(config, model_config, x, codec) if config is not None else []
    managed = sum(c.rows * c.cols for c in layers)
    other = params - managed  # fp32 on every hop
    codec_s = stats_s = refresh_s = 0.0
    if layout == "flat":
        net_bytes = sum(_rs_sent(c.plan, p) for c in layers) + (p - 1) / p * 4.0 * other
        nvl_bytes = 0.0
    else:
        replica_fmt = config.replica_hop_format if config is not None else "fp32"
        nvl_bytes = sum(_rs_sent(c.plan, g) for c in layers) + (g - 1) / g * 4.0 * other
        net_bytes = 2.0 * (n - 1) / n * 4.0 * other / g  # unmanaged shards: ring all-reduce at fp32
        for c in layers:
            shard = dataclasses.replace(c.plan, rows=c.rows // g, format=replica_fmt)
            if replica_fmt == "fp32":
                net_bytes += 2.0 * (n - 1) / n * 4.0 * shard.numel
            else:
                net_bytes += _ar_sent(shard, n)
                codec_s += codec(shard, 0) * shard.numel / hbm
    for c in layers:
        codec_s += c.codec_bytes / hbm + c.transform_flops / fp32_rate
        stats_s += c.stats_flops / fp32_rate
        refresh_s += c.refresh_flops / (x.refresh_tflops * 1e12)
    net_s, nvl_s = net_bytes / net, nvl_bytes / nvl
    exposed = x.exposed_fraction * (net_s + nvl_s)
    step = compute + exposed + codec_s + stats_s + refresh_s
    return {"compute_s": compute, "network_s": net_s, "nvlink_s": nvl_s, "exposed_comm_s": exposed,
            "codec_s": codec_s, "stats_s": stats_s, "refresh_s": refresh_s, "step_s": step,
            "network_bytes": net_bytes, "nvlink_bytes": nvl_bytes}


def run(models: tuple[str, ...] = ("Llama-600M", "Llama-3-8B")) -> dict[str, object]:
    results = json.loads((RESULTS / "results.json").read_text())
    f = results["step_model"]["calibrated_exposed_fraction"]
    x = dataclasses.replace(StepModelInputs(), gpus=64, exposed_fraction=f)
    h = HsdpInputs()
    codec = measured_codec(results)
    table = {}
    for model in models:
        rows = {arm: project_arm(layout, cfg, model, x, h, codec) for arm, (layout, cfg) in ARMS.items()}
        base = rows["FSDP fp32"]["step_s"]
        for r in rows.values():
            r["vs_fsdp_fp32"] = r["step_s"] / base - 1.0
        table[model] = rows
    return {"sources": SOURCES, "inputs": dataclasses.asdict(x), "topology": dataclasses.asdict(h),
            "exposed_fraction": f, "arms": {a: (l, c.to_dict() if c else None) for a, (l, c) in ARMS.items()},
            "models": table}


def markdown(out: dict) -> str:
    lines = []
    for model, rows in out["models"].items():
        lines += [f"\n{model}, 8 nodes x 8 GPUs (exposed share {out['exposed_fraction']:.3f}, calibrated)\n",
                  "| arm (shard hop / replica hop) | network MB/GPU | NVLink MB/GPU | exposed comm ms | codec+stats+refresh ms | step ms | vs FSDP fp32 |",
                  "|---|---|---|---|---|---|---|"]
        for arm, r in rows.items():
            extra = (r["codec_s"] + r["stats_s"] + r["refresh_s"]) * 1e3
            lines.append(f"| {arm} | {r['network_bytes'] / 1e6:.1f} | {r['nvlink_bytes'] / 1e6:.1f} | "
                         f"{r['exposed_comm_s'] * 1e3:.1f} | {extra:.1f} | {r['step_s'] * 1e3:.1f} | "
                         f"{r['vs_fsdp_fp32'] * 100:+.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    out = run()
    (RESULTS / "step_model" / "hsdp_step_model.json").write_text(json.dumps(out, indent=1))
    text = "Inputs:\n" + "\n".join(f"- {k}: {v}" for k, v in SOURCES.items()) + "\n" + markdown(out) + "\n"
    (RESULTS / "step_model" / "hsdp_step_model.md").write_text("# HSDP step-time projection (`python -m bench.step_model.hsdp`)\n\n" + text)
    print(text)
    sys.exit(0)
