"""The step model: what each way of moving gradients costs a data-parallel training step, on a
cluster laid out as nodes of g GPUs, with the same rules for every arm; validated against the
emulated cluster (`--validate`).

    python -m bench.step_model.topology                               # the regime tables
    python -m bench.step_model.topology --validate <results json>     # predicted vs measured

The first writes `bench/results/step_model/topology_model.json` (and its plot); the second sets
the model against an emulated-cluster results JSON (`bench.cluster.emulated`, e.g.
`bench/results/cluster/emulated.json`).

Inputs: every number is in `bench/results/step_model/step_model_inputs.json` (`INPUTS_FILE`),
each marked `measured` (with the command that measured it) or `assumed` (with the public source
it stands for); a test fails on an unmarked one. One network = one NIC rate per GPU, one
efficiency, one fast-link (NVLink) bus bandwidth, one latency, `gpus_per_node`: rings and
all-to-alls on it are priced from the same efficiency (`Net`).

Structure (the same for every arm; `_phase` and `price_arm`):

- compute: `6 P tokens / (peak MFU)` (a cited whole-step MFU, not GEMMs alone), split into the
  forward (`forward_share`) and the backward; in calibration the whole measured step of the arm
  on an unshaped link (`validate`).
- collectives, per GPU: a ring over W = n g GPUs moves `(W-1)/W` of its buffer per GPU; its bytes
  cross each node boundary once, so a node's NICs carry `(W-1)/W S` (rate g x NIC); its NVLink
  hops run at the same time (the ring pipelines them: `max`, never a sum). A flat all-to-all
  sends `(W-g)/W` of each GPU's codes through that GPU's own NIC, the rest over NVLink (`max`).
  A two-level exchange (GIFT's `node_stage`, HSDP) reduce-scatters inside the node at
  `intra_node_bytes`, then all-to-alls the node's 1/g chunk across nodes: the stages of
  consecutive buckets run at once, so the pair costs the slower stage plus one bucket of the
  faster (pipeline fill), not their sum. Each collective call adds `latency x (nodes - 1)`.
- FSDP (flat and HSDP) all-gathers the parameters at `param_bytes_allgathered` in the forward and
  again in the backward, in every FSDP arm (`ARMS`: `allgathers`); HSDP's all-gathers and its
  reduce-scatter stay in the node, only the replica all-reduce of the 1/g shard crosses nodes.
- overlap, as FSDP2 and DDP do it, in B units (FSDP units or DDP buckets): a phase of compute C
  and link work L costs `max(C + L/B, L + C/B)`: communication hides behind compute except the
  exposed tail (the last unit's), or compute hides behind communication except the first unit's.
  The forward overlaps the all-gathers; the backward overlaps the backward all-gathers and the
  gradient exchange. GIFT's exchange (and the Euclidean arms', the same code) is overlapped or
  not by the switch `gift_exchange_overlapped`; not overlapped, it adds its whole link time.
- on the compute stream (added to the backward's compute): the codec at its wall time (the H200
  bodies; the host's launch floor where launch-bound), GIFT's statistics (FLOPs counted in the
  code, at an assumed fp32 rate), PowerSGD's matmuls; the sharded refresh after the backward.

Arms (`ARMS`): fp32 and bf16 ring reduce-scatters, Euclidean and GIFT flat and two-level, HSDP
with a bf16 ring / Euclidean / GIFT on the replica hop (all FSDP2), and torch's PowerSGD hook
on DDP. Every low-bit arm at equal bits (the bits of GIFT's fewest within fp32's noise on the
frontier) and at equal quality (Euclidean at the bits of its own fewest within fp32's noise):
`bits_from_frontier`. Matrices travel at the arm's bits (the map on GIFT's eligible linears, the
embedding and head in plain coordinates), vectors at `unmanaged_bytes`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import statistics
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.paths import RESULTS, ROOT
from bench.lib.stats import median_ci
from bench.lib.tiny_llama import TinyLlamaConfig
from bench.lib.wire import MODEL_CONFIGS, meta_model
from bench.step_model.cpu import StepModelInputs, arm_layers
from bench.step_model.pricing import PATHS, CodecPricer, load_bodies
from gift_compile.codec.spec import FormatSpec
from gift_compile.config import GiftConfig

INPUTS_FILE = RESULTS / "step_model" / "step_model_inputs.json"
OUT = RESULTS / "step_model" / "topology_model.json"
PLOT = RESULTS / "step_model" / "topology_model.png"
COMMAND = "python -m bench.step_model.topology"
MODELS = ("Llama-600M", "Llama-3-8B", "Llama-3-70B")
OPTIMIZER = "muon"  # the frontier's optimizer for the bits (GIFT's map is for matrix preconditioners)
PSGD_ARMS = ("PowerSGD (DDP)",)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: how its gradients travel (`exchange`), where the parameters live (`layout`:
    "fsdp" sharded over every GPU, "hsdp" sharded in the node and replicated across, "ddp"
    replicated) and which codec it runs ("gift", "euclid" or None)."""

    layout: str
    exchange: str  # ring32, ring16, a2a, two_level, hsdp_ring16, hsdp_a2a, powersgd, ddp_ring32, ddp_ring16, ddp_a2a, ddp_two_level
    codec: str | None = None

    @property
    def allgathers(self) -> bool:
        """FSDP and HSDP arms all-gather the parameters in the forward and the backward."""
        return self.layout in ("fsdp", "hsdp")

    @property
    def gift_code(self) -> bool:
        """Whether the exchange is GIFT's own code (the overlap switch applies)."""
        return self.codec is not None


ARMS: dict[str, ArmSpec] = {
    "fp32 ring": ArmSpec("fsdp", "ring32"),
    "bf16 ring": ArmSpec("fsdp", "ring16"),
    "Euclidean flat": ArmSpec("fsdp", "a2a", "euclid"),
    "Euclidean two-level": ArmSpec("fsdp", "two_level", "euclid"),
    "GIFT flat": ArmSpec("fsdp", "a2a", "gift"),
    "GIFT two-level": ArmSpec("fsdp", "two_level", "gift"),
    "HSDP bf16": ArmSpec("hsdp", "hsdp_ring16"),
    "HSDP + Euclidean replica hop": ArmSpec("hsdp", "hsdp_a2a", "euclid"),
    "HSDP + GIFT replica hop": ArmSpec("hsdp", "hsdp_a2a", "gift"),
    "PowerSGD (DDP)": ArmSpec("ddp", "powersgd"),
}
GIFT_ARMS = tuple(a for a, s in ARMS.items() if s.codec == "gift")
EUCLID_ARMS = tuple(a for a, s in ARMS.items() if s.codec == "euclid")
BASELINES = ("bf16 ring", "HSDP bf16")  # the 16-bit production bar, flat or HSDP


# ---------------------------------------------------------------------------------------------
# inputs


def load_inputs(path: Path = INPUTS_FILE) -> dict[str, Any]:
    """The inputs file, checked: every leaf input is marked (`check_marked`)."""
    d = json.loads(path.read_text())
    check_marked(d)
    return d


def _inputs(d: Any, where: str = "") -> list[tuple[str, dict]]:
    """Every input entry (a dict with a `value`) with its dotted place in the file."""
    out: list[tuple[str, dict]] = []
    if isinstance(d, dict):
        if "value" in d:
            return [(where, d)]
        for k, v in d.items():
            out += _inputs(v, f"{where}.{k}" if where else k)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _inputs(v, f"{where}[{i}]")
    return out


def check_marked(d: dict) -> None:
    """Raise naming each input that is not marked `measured` with a `command` or `assumed` with
    a `source`: an unsourced number would be a number typed in."""
    bad = [w for w, e in _inputs(d) if not ((e.get("kind") == "measured" and e.get("command"))
                                            or (e.get("kind") == "assumed" and e.get("source")))]
    if bad:
        raise ValueError(f"step model inputs without a measured/assumed marking and its command/source: {bad}; "
                         f"mark each in {INPUTS_FILE.relative_to(ROOT)}")


def _v(entry: dict) -> Any:
    return entry["value"]


@dataclass(frozen=True)
class Net:
    """One network at one node count: the rates every collective on it is priced from (bytes/s
    per GPU after the network's one efficiency, NVLink bus bandwidth, latency per crossing)."""

    name: str
    nodes: int
    g: int
    nic: float  # bytes/s per GPU across nodes, efficiency applied
    fast: float  # bytes/s of the node's fast link (bus bandwidth); inf: priced inside the measured compute
    latency: float  # s per node crossing of one collective call
    efficiency: float

    @property
    def world(self) -> int:
        return self.nodes * self.g


def efficiency(entry: dict, nodes: int) -> float:
    """The network's one efficiency at `nodes` nodes: a number, or anchors by node count linear
    in log2(nodes) between them and flat outside."""
    v = _v(entry)
    if not isinstance(v, dict):
        return float(v)
    anchors = sorted((int(k), float(x)) for k, x in v.items())
    if nodes <= anchors[0][0]:
        return anchors[0][1]
    for (n0, e0), (n1, e1) in zip(anchors, anchors[1:]):
        if nodes <= n1:
            t = (math.log2(nodes) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return e0 + t * (e1 - e0)
    return anchors[-1][1]


def network(entry: dict, nodes: int) -> Net:
    eff = efficiency(entry["efficiency"], nodes)
    return Net(entry["name"], nodes, int(_v(entry["gpus_per_node"])), _v(entry["nic_gbytes_per_gpu"]) * 1e9 * eff,
               _v(entry["fast_gbytes"]) * 1e9, _v(entry["latency_us"]) * 1e-6, eff)


# ---------------------------------------------------------------------------------------------
# the model's shapes and GIFT's per-layer work


@dataclass(frozen=True)
class Shapes:
    """What travels: every matrix `(rows, cols, mapped)` (mapped: GIFT's map runs on it) and the
    vector elements; GIFT's statistics FLOPs per step and refresh FLOPs per step (unsharded)."""

    matrices: tuple[tuple[int, int, bool], ...]
    vector_elements: int
    n_layers: int
    stats_flops: float
    refresh_flops: float

    @property
    def params(self) -> int:
        return sum(r * c for r, c, _ in self.matrices) + self.vector_elements

    @property
    def matrix_elements(self) -> int:
        return sum(r * c for r, c, _ in self.matrices)


@functools.cache
def shapes(config: TinyLlamaConfig, tokens: int, refresh_every: int, rank: int) -> Shapes:
    """The model's matrices and vectors (a meta model), the linears GIFT maps (a meta `GiftState`
    with the map on every eligible layer) and their statistics / refresh FLOPs (counted on one
    block, whose layers every block repeats, times the block count)."""
    gift = GiftConfig(format="nvfp4", geometry="lowrank", select="all", refresh_every=refresh_every, rank=rank)
    x = StepModelInputs(gpus=1, tokens_per_gpu=tokens, refresh_sharded=False)
    one = arm_layers(gift, dataclasses.replace(config, n_layers=1), x, lambda plan, r: 0.0)
    mapped = {re.sub(r"^layers\.0\.", "layers.", c.fqn.removesuffix(".weight")) for c in one}
    mats, vec = [], 0
    for name, p in meta_model(config).named_parameters():
        if p.dim() == 2:
            key = re.sub(r"^layers\.\d+\.", "layers.", name.removesuffix(".weight"))
            mats.append((p.shape[0], p.shape[1], key in mapped))
        else:
            vec += p.numel()
    n = config.n_layers
    return Shapes(tuple(mats), vec, n, n * sum(c.stats_flops for c in one), n * sum(c.refresh_flops for c in one))


def format_bits(fields: dict[str, Any], rows: int = 4096, cols: int = 4096) -> float:
    """Wire bits per element of a GiftConfig's format (payload and scales) at a large matrix."""
    return FormatSpec(fields["format"], fields.get("scaling", "row"), fields.get("block_size", 32)).bits_per_element(
        cols, rows)


def bits_from_frontier(frontier: dict, optimizer: str = OPTIMIZER) -> dict[str, Any]:
    """The bits the frontier says reach the same loss: GIFT's fewest bits within fp32's noise
    (over its methods) and Euclidean's (over its methods), with the arms they come from."""
    o = frontier["optimizers"][optimizer]
    bits = {a["arm"]: a["bits_managed"] for a in o["arms"]}
    out = {}
    for who, prefix in (("gift", "GIFT"), ("euclid", "Euclidean")):
        arms = [a for m, a in o["fewest_within"].items() if m.startswith(prefix) and a]
        if not arms:
            raise ValueError(f"frontier: no {prefix} method within fp32's noise under {optimizer}")
        best = min(arms, key=lambda a: bits[a])
        out[who] = {"arm": best, "bits": bits[best]}
    return out


# ---------------------------------------------------------------------------------------------
# pricing


def _phase(compute: float, link: float, units: int | list[float], overlapped: bool = True) -> float:
    """A phase of `compute` seconds and `link` seconds of communication in `units` (a count of
    equal units, or each unit's share of the bytes, in the order they become ready): overlapped,
    a unit's communication starts when its compute is done and the previous unit's has left
    (exposed: the communication after the last compute, or the compute before the first unit)."""
    if not overlapped:
        return compute + link
    shares = [1.0 / units] * units if isinstance(units, int) else units
    t = done = 0.0
    for share in shares:
        done += share
        t = max(t, compute * done) + link * share
    return max(compute, t)


def ddp_shares(nbytes: float, x: dict[str, Any]) -> list[float]:
    """DDP's buckets of an `nbytes` fp32 gradient as shares, in the order they are ready: a first
    bucket of 1 MB (torch's `_DEFAULT_FIRST_BUCKET_BYTES`), then `ddp_bucket_mb` each."""
    first, cap = 1e6, _v(x["ddp_bucket_mb"]) * 1e6
    if nbytes <= first:
        return [1.0]
    full, rest = divmod(nbytes - first, cap)
    return [first / nbytes] + [cap / nbytes] * int(full) + ([rest / nbytes] if rest else [])


def _ring(nbytes: float, net: Net, calls: int, allreduce: bool = False) -> float:
    """A ring reduce-scatter (or all-gather; x2 for an all-reduce) of an `nbytes` buffer per GPU
    over every GPU: the node's NICs carry (W-1)/W of it, NVLink the same at its bus bandwidth,
    pipelined (the slower of the two)."""
    w = net.world
    moved = nbytes * (w - 1) / w * (2 if allreduce else 1)
    if net.nodes == 1:
        return moved / net.fast
    return max(moved / (net.nic * net.g), moved / net.fast) + calls * net.latency * (net.nodes - 1)


def _ring_in_node(nbytes: float, net: Net) -> float:
    """A reduce-scatter or all-gather of `nbytes` per GPU over the node's g GPUs (NVLink)."""
    return nbytes * (net.g - 1) / net.g / net.fast


def _a2a(nbytes: float, net: Net, calls: int) -> float:
    """A flat all-to-all of `nbytes` of codes per GPU over every GPU: (W-g)/W through the GPU's
    own NIC, (g-1)/W over NVLink, at once (the slower)."""
    w = net.world
    return max(nbytes * (w - net.g) / w / net.nic, nbytes * (net.g - 1) / w / net.fast) + calls * net.latency * (
        net.nodes - 1)


def _across(nbytes: float, net: Net, calls: int, allreduce: bool) -> float:
    """The cross-node stage of a two-level exchange: `nbytes` of this GPU's 1/g chunk among the n
    GPUs of its local rank (an all-to-all; with `allreduce` also the all-gather of the reduced
    codes, GIFT's all-reduce), through the GPU's own NIC."""
    n = net.nodes
    moved = nbytes * (n - 1) / n * (2 if allreduce else 1)
    return moved / net.nic + calls * net.latency * (n - 1) * (2 if allreduce else 1)


def _pipelined(stage1: float, stage2: float, units: int) -> float:
    """Two stages of a two-level exchange over `units` buckets: the slower stage plus one bucket
    of the faster (consecutive buckets' stages run at once)."""
    return max(stage1, stage2) + min(stage1, stage2) / units


@dataclass(frozen=True)
class Costs:
    """Per step and GPU, seconds, of one model on one GPU kind (the compute side)."""

    forward: float
    backward: float
    codec: dict[str, float]  # "gift"/"euclid"/"powersgd" on the compute stream, flat and per node chunk
    stats: float
    refresh: float  # unsharded, per step


def psgd_bytes_and_flops(sh: Shapes, rank: int, min_rate: float) -> tuple[float, float]:
    """torch's PowerSGD hook on one step: bytes handed to its all-reduces (P and Q of each
    compressed matrix at fp32, every other tensor uncompressed at fp32) and its matmul FLOPs
    (M Q, Mᵀ P, the P Qᵀ decompression, the Gram-Schmidt of P)."""
    nbytes = 4.0 * sh.vector_elements
    flops = 0.0
    for r, c, _ in sh.matrices:
        if (r + c) * rank * min_rate < r * c:
            nbytes += 4.0 * rank * (r + c)
            flops += 3 * 2.0 * r * c * rank + 2.0 * r * rank * rank
        else:
            nbytes += 4.0 * r * c
    return nbytes, flops


_CODEC_CACHE: weakref.WeakKeyDictionary[CodecPricer, dict[tuple[Shapes, str, int], dict[str, float]]] = (
    weakref.WeakKeyDictionary())


def codec_seconds(sh: Shapes, pricer: CodecPricer, fmt: str, chunk: int) -> dict[str, float]:
    """The codec's wall time per step (launch-bound where that is larger than the device time) of
    every matrix at `rows // chunk` rows: the GIFT path on mapped matrices and the Euclidean path
    on the rest, or the Euclidean path on all; `fmt` the measured format it is priced at."""
    cache = _CODEC_CACHE.setdefault(pricer, {})
    key = (sh, fmt, chunk)
    if key in cache:
        return cache[key]
    gift = euclid = 0.0
    for r, c, mapped in sh.matrices:
        rows = max(1, r // chunk)
        e = pricer.price(PATHS[("identity", fmt)], rows, c).wall_us
        euclid += e
        gift += pricer.price(PATHS[("lowrank", fmt)], rows, c).wall_us if mapped else e
    cache[key] = {"gift": gift * 1e-6, "euclid": euclid * 1e-6}
    return cache[key]


def price_arm(arm: str, sh: Shapes, net: Net, compute: tuple[float, float], extra: dict[str, float],
              bits: float, x: dict[str, Any], psgd: tuple[float, float]) -> dict[str, float]:
    """One arm's step in seconds: `{"forward", "backward", "link", "on_compute", "step", ...}`.

    `compute`: (forward, backward) compute seconds; `extra`: what the arm runs on the compute
    stream besides (codec, statistics) and after the backward (refresh), already chosen for its
    layout; `bits`: wire bits per matrix element of a low-bit arm; `psgd`: PowerSGD's (bytes,
    compute seconds)."""
    spec = ARMS[arm]
    g, n = net.g, net.nodes
    fwd_c, bwd_c = compute
    units = sh.n_layers + 1  # FSDP units: one per block and the root
    m, v = float(sh.matrix_elements), float(sh.vector_elements)
    pbytes = _v(x["param_bytes_allgathered"]) * sh.params
    vec = v * _v(x["unmanaged_bytes"])
    low = codes_bytes(sh, bits, x)  # this GPU's codes: matrices at the arm's bits, vectors at unmanaged_bytes
    node_b = _v(x["intra_node_bytes"])
    overlapped = not spec.gift_code or bool(_v(x["gift_exchange_overlapped"]))
    ag_f = ag_b = 0.0
    if spec.layout == "fsdp":
        ag_f = ag_b = _ring(pbytes, net, units)
    elif spec.layout == "hsdp":
        ag_f = ag_b = _ring_in_node(pbytes, net)
    ddp_buckets = len(ddp_shares(4.0 * sh.params, x))
    ex = spec.exchange
    if ex == "ring32":
        link = _ring(4.0 * sh.params, net, units)
    elif ex == "ring16":
        link = _ring(2.0 * sh.params, net, units)
    elif ex == "a2a":
        link = _a2a(low, net, units)
    elif ex == "two_level":
        link = _pipelined(_ring_in_node(node_b * m + vec, net), _across(low / g, net, units, False), units)
    elif ex == "hsdp_ring16":
        across = 2.0 * 2 * (n - 1) / n * sh.params / g / net.nic + units * net.latency * 2 * (n - 1)
        link = _pipelined(_ring_in_node(2.0 * sh.params, net), across, units)
    elif ex == "hsdp_a2a":
        link = _pipelined(_ring_in_node(node_b * m + vec, net), _across(low / g, net, units, True), units)
    elif ex == "powersgd":  # two all-reduces (P, then Q) per DDP bucket of the fp32 gradient
        link = _ring(psgd[0], net, 2 * ddp_buckets, allreduce=True)
    else:
        raise ValueError(f"step model: unknown exchange {ex!r} of arm {arm!r}")
    on_compute = sum(extra.get(k, 0.0) for k in ("codec", "stats", "psgd"))
    b_units: int | list[float] = units if spec.layout != "ddp" else ddp_shares(4.0 * sh.params, x)
    forward = _phase(fwd_c, ag_f, units) if spec.allgathers else fwd_c
    if overlapped:
        backward = _phase(bwd_c + on_compute, ag_b + link, b_units)
    else:
        backward = _phase(bwd_c + on_compute, ag_b, b_units) + link
    step = forward + backward + extra.get("refresh", 0.0)
    return {"forward": forward, "backward": backward, "allgather": ag_f + ag_b, "link": link,
            "on_compute": on_compute, "refresh": extra.get("refresh", 0.0), "compute": fwd_c + bwd_c, "step": step}


def codes_bytes(sh: Shapes, bits: float, x: dict[str, Any]) -> float:
    """Bytes of one GPU's gradient in a low-bit arm's collective: mapped matrices at `bits`, the
    other matrices at `bits` too (plain coordinates) unless `unmapped_matrix_bytes` says otherwise
    (the code before the whole-gradient compression sent them at fp32), vectors at `unmanaged_bytes`."""
    plain = x.get("unmapped_matrix_bytes", {"value": None})["value"]
    out = sh.vector_elements * _v(x["unmanaged_bytes"])
    for r, c, mapped in sh.matrices:
        out += r * c * (bits / 8 if mapped or plain is None else plain)
    return out


def _fits(arm: str, sh: Shapes, net: Net, memory_gb: float, state_bytes: float) -> bool:
    """Whether the arm's model state (parameters, gradients, optimizer) fits one GPU's memory:
    FSDP shards it over every GPU, HSDP over the node's g, DDP keeps a replica."""
    shard = {"fsdp": net.world, "hsdp": net.g, "ddp": 1}[ARMS[arm].layout]
    return state_bytes * sh.params / shard <= memory_gb * 1e9


def price_all(model: str, entry: dict, nodes: int, bits: dict[str, float], x: dict, gpus: dict, models: dict,
              pricer: CodecPricer, fmt_codec: str, arms: tuple[str, ...] = tuple(ARMS),
              overlapped: bool | None = None) -> dict[str, dict[str, float]]:
    """Every arm of `model` on network `entry` at `nodes` nodes; `bits` per codec ("gift",
    "euclid") in bits per matrix element."""
    net = network(entry, nodes)
    gpu = gpus[entry["gpu"]]
    mi = models[model]
    tokens = int(_v(mi["tokens_per_gpu"]))
    sh = shapes(MODEL_CONFIGS[model], tokens, int(_v(x["refresh_every"])), int(_v(x["gift_rank"])))
    total = 6.0 * sh.params * tokens / (_v(gpu["peak_bf16_tflops"]) * 1e12 * _v(mi["mfu"]))
    fwd = total * _v(x["forward_share"])
    fp32_rate = _v(gpu["fp32_tflops"]) * 1e12 * _v(x["fp32_tflops_share"])
    stats = sh.stats_flops / fp32_rate
    refresh = sh.refresh_flops / (_v(x["refresh_tflops"]) * 1e12) / net.world
    flat = codec_seconds(sh, pricer, fmt_codec, 1)
    chunk = codec_seconds(sh, pricer, fmt_codec, net.g)
    psgd_bytes, psgd_flops = psgd_bytes_and_flops(sh, int(_v(x["powersgd_rank"])), _v(x["powersgd_min_compression_rate"]))
    xx = dict(x)
    if overlapped is not None:
        xx["gift_exchange_overlapped"] = {"value": overlapped}
    out = {}
    for arm in arms:
        spec = ARMS[arm]
        extra: dict[str, float] = {}
        if spec.codec is not None:
            per = flat if spec.exchange == "a2a" else chunk
            extra["codec"] = per[spec.codec]
            if spec.codec == "gift":
                extra["stats"], extra["refresh"] = stats, refresh
        if spec.exchange == "powersgd":
            extra["psgd"] = psgd_flops / fp32_rate
        r = price_arm(arm, sh, net, (fwd, total - fwd), extra, bits.get(spec.codec or "", 32.0), xx,
                      (psgd_bytes, psgd_flops))
        r["fits"] = _fits(arm, sh, net, _v(gpu["memory_gb"]), _v(x["state_bytes_per_param"]))
        out[arm] = r
    return out


def run(inputs_path: Path = INPUTS_FILE) -> dict[str, Any]:
    """Every model x network x node count, each arm at equal bits and at equal quality, both
    with GIFT's exchange overlapped and not; the paper's setting."""
    d = load_inputs(inputs_path)
    x, gpus, models = d["global"], d["gpus"], d["models"]
    frontier = json.loads((ROOT / _v(x["frontier"])).read_text())
    fb = bits_from_frontier(frontier)
    settings = {"equal bits": {"gift": fb["gift"]["bits"], "euclid": fb["gift"]["bits"]},
                "equal quality": {"gift": fb["gift"]["bits"], "euclid": fb["euclid"]["bits"]}}
    pricer = CodecPricer(load_bodies(ROOT / _v(x["codec_bodies"])))
    fmt = _v(x["codec_low_bit_proxy"])
    codec_fmt = {"nvfp4": "nvfp4", "fp8": "fp8_e4m3"}[fmt]
    rows = []
    for model in MODELS:
        for entry in d["networks"]:
            for nodes in entry["nodes"]:
                for setting, bits in settings.items():
                    for ov in (True, False):
                        arms = price_all(model, entry, nodes, bits, x, gpus, models, pricer, codec_fmt, overlapped=ov)
                        rows.append({"model": model, "network": entry["name"], "nodes": nodes,
                                     "gpus_per_node": int(_v(entry["gpus_per_node"])), "setting": setting,
                                     "gift_overlapped": ov, "bits": bits, "arms": arms})
    return {"command": COMMAND, "inputs_file": str(inputs_path.relative_to(ROOT)), "inputs": d,
            "bits_from_frontier": fb, "optimizer": OPTIMIZER, "rows": rows, "paper": paper_setting(d, pricer)}


def paper_setting(d: dict, pricer: CodecPricer) -> dict[str, Any]:
    """The paper's setting: Llama-600M on 64 GH200 (16 nodes x 4), the data-parallel all-reduce
    it ran: fp32 ring against Euclidean FP8 and GIFT FP8 with the map on 13 fc2 layers (every
    other matrix on the Euclidean codec, every gradient at FP8), flat all-to-all exchange."""
    x, p = d["global"], d["paper"]
    entry = next(e for e in d["networks"] if e["name"] == p["network"])
    net = network(entry, p["nodes"])
    gpu, mi = d["gpus"][entry["gpu"]], d["models"][p["model"]]
    tokens = int(_v(mi["tokens_per_gpu"]))
    cfg = MODEL_CONFIGS[p["model"]]
    sh = shapes(cfg, tokens, int(_v(x["refresh_every"])), int(_v(x["gift_rank"])))
    fc2 = tuple(f"layers.{i}.feed_forward.w2.weight" for i in range(13))
    gift13 = arm_layers(GiftConfig(format="fp8_e5m2", scaling="tensor", geometry="lowrank", select=fc2,
                                   refresh_every=int(_v(x["refresh_every"]))), cfg,
                        StepModelInputs(gpus=1, tokens_per_gpu=tokens, refresh_sharded=False), lambda plan, r: 0.0)
    selected = {c.fqn.removesuffix(".weight") for c in gift13 if c.stats_flops > 0}
    sh13 = Shapes(tuple((r, c, False) for r, c, _ in sh.matrices), sh.vector_elements, sh.n_layers, 0.0, 0.0)
    total = 6.0 * sh.params * tokens / (_v(gpu["peak_bf16_tflops"]) * 1e12 * _v(mi["mfu"]))
    fwd = total * _v(x["forward_share"])
    fp32_rate = _v(gpu["fp32_tflops"]) * 1e12 * _v(x["fp32_tflops_share"])
    euclid_codec = codec_seconds(sh13, pricer, "fp8_e4m3", 1)["euclid"]
    fc2_shape = (cfg.dim, MODEL_CONFIGS[p["model"]].ffn_hidden)
    gift_extra = 13 * (pricer.price(PATHS[("lowrank", "fp8_e4m3")], *fc2_shape).wall_us
                       - pricer.price(PATHS[("identity", "fp8_e4m3")], *fc2_shape).wall_us) * 1e-6
    stats = sum(c.stats_flops for c in gift13) / fp32_rate
    refresh = sum(c.refresh_flops for c in gift13) / (_v(x["refresh_tflops"]) * 1e12) / net.world
    bits = format_bits({"format": "fp8_e5m2", "scaling": "tensor"})
    shares = ddp_shares(4.0 * sh.params, x)
    buckets = len(shares)
    variants: dict[str, dict[str, dict[str, float]]] = {}
    for variant, every_overlapped in (("overlapped", True), ("nothing overlapped", False)):
        out = variants.setdefault(variant, {})
        for name, collective, extra in (("fp32 all-reduce", "ring", {}), ("Euclidean FP8", "a2a", {"codec": euclid_codec}),
                                  ("GIFT FP8 (13 fc2)", "a2a", {"codec": euclid_codec + gift_extra, "stats": stats,
                                                                "refresh": refresh})):
            if collective == "ring":
                link = _ring(4.0 * sh.params, net, buckets, allreduce=True)
            else:  # GIFT's all-reduce: an all-to-all of the codes and an all-gather of the reduced codes
                link = 2 * _a2a((sh.matrix_elements + sh.vector_elements) * bits / 8, net, buckets)
            on = extra.get("codec", 0.0) + extra.get("stats", 0.0)
            backward = _phase(total - fwd + on, link, shares, every_overlapped)
            out[name] = {"step": fwd + backward + extra.get("refresh", 0.0), "link": link, "on_compute": on,
                         "compute": total}
    res = {}
    for variant, out in variants.items():
        base = out["fp32 all-reduce"]["step"]
        res[variant] = {"arms": out, "gift_vs_fp32": out["GIFT FP8 (13 fc2)"]["step"] / base - 1,
                        "euclid_vs_fp32": out["Euclidean FP8"]["step"] / base - 1,
                        "gift_vs_euclid": out["GIFT FP8 (13 fc2)"]["step"] / out["Euclidean FP8"]["step"] - 1}
    return {"model": p["model"], "network": p["network"], "nodes": p["nodes"], "gpus_per_node": net.g,
            "selected": sorted(selected), **res,
            "paper_gift_vs_fp32": _v(p["gift_vs_fp32"]), "paper_euclid_vs_fp32": _v(p["euclid_fp8_vs_fp32"])}


# ---------------------------------------------------------------------------------------------
# validation against the emulated cluster (`bench.cluster.emulated`'s results JSON)

TC_FRAME_EFFICIENCY = 1448 / 1514  # tc's tbf counts whole Ethernet frames: 1448 TCP payload bytes per 1514
TOLERANCE = 0.15
_NODE_KEYS, _G_KEYS = ("nodes", "nnodes"), ("gpus_per_node", "ranks_per_node", "nproc_per_node")
_RATE_KEYS, _DELAY_KEYS = ("rate_mbit", "link_mbit", "mbit"), ("delay_ms",)


def _first(d: dict, keys: tuple[str, ...]) -> Any:
    return next((d[k] for k in keys if k in d), None)


def records(results: Any, context: dict | None = None) -> list[dict[str, Any]]:
    """Every arm record (a dict with `arm`, `path` and `step_times`) in an emulated-cluster
    results JSON (`bench.cluster.emulated`: its `records`), with the layout and link it ran on
    taken from it or from the nearest enclosing dict that names them (`nodes`, `ranks_per_node`,
    `rate_bps` or `rate_mbit` (absent or null: unshaped), `delay_ms`)."""
    if context is None and isinstance(results, dict) and isinstance(results.get("records"), list):
        return records(results["records"], {k: results[k] for k in _DELAY_KEYS if k in results})
    ctx = dict(context or {})
    out: list[dict[str, Any]] = []
    if isinstance(results, dict):
        for keys, name in ((_NODE_KEYS, "nodes"), (_G_KEYS, "g"), (_DELAY_KEYS, "delay_ms")):
            if any(k in results for k in keys):
                ctx[name] = _first(results, keys)
        if "rate_bps" in results:
            ctx["rate_mbit"] = None if results["rate_bps"] is None else results["rate_bps"] / 1e6
        elif any(k in results for k in _RATE_KEYS):
            ctx["rate_mbit"] = _first(results, _RATE_KEYS)
        if {"arm", "path", "step_times"} <= set(results):
            missing = [k for k in ("nodes", "g") if ctx.get(k) is None]
            if missing:
                raise ValueError(f"emulated-cluster record {results['arm']!r} on {results['path']!r} has no {missing}: "
                                 f"the results JSON must name its layout ({_NODE_KEYS[0]}, {_G_KEYS[1]})")
            return [{**results, "nodes": int(ctx["nodes"]), "g": int(ctx["g"]), "rate_mbit": ctx.get("rate_mbit"),
                     "delay_ms": float(ctx.get("delay_ms") or 0.0)}]
        for v in results.values():
            out += records(v, ctx)
    elif isinstance(results, list):
        for v in results:
            out += records(v, ctx)
    return out


def model_config(results: dict) -> TinyLlamaConfig:
    """The emulated cluster's model: `model_config` (TinyLlamaConfig fields) or `model.config`
    (`bench.cluster.emulated`: with `ffn_hidden`, matched by the smallest `multiple_of` that gives it)."""
    cfg = results.get("model_config") or (results.get("model") or {}).get("config")
    if not isinstance(cfg, dict):
        raise ValueError("emulated-cluster results JSON has no model_config / model.config (its TinyLlamaConfig)")
    cfg = dict(cfg)
    ffn = cfg.pop("ffn_hidden", None)
    if ffn is None:
        return TinyLlamaConfig(**cfg)
    for m in (2 ** k for k in range(1, 12)):
        c = TinyLlamaConfig(**cfg, multiple_of=m)
        if c.ffn_hidden == ffn:
            return c
    raise ValueError(f"emulated-cluster model: no multiple_of gives ffn_hidden {ffn} for {cfg}")


def median_step(rec: dict) -> float:
    return statistics.median(timed_steps(rec))


def timed_steps(rec: dict) -> list[float]:
    """A record's step times after its warm-up."""
    return rec["step_times"][int(rec.get("warmup", 0)):]


def timed_count(rec: dict) -> int:
    """How many timed steps a record's byte counters cover (`steps`, else its timed step times)."""
    return int(rec.get("steps") or len(timed_steps(rec)))


def emulated_arm(name: str, path: str) -> tuple[ArmSpec, dict[str, Any] | None, float]:
    """The structure of an emulated-cluster arm (`bench.cluster.emulated_worker.ARMS` names):
    its `ArmSpec`, its GiftConfig fields (None: native or PowerSGD) and the bytes per parameter
    its FSDP all-gathers move (fp32, or bf16 for the `-bf16p` arms)."""
    from gift_compile import recipes

    pbytes = 2.0 if name.endswith("-bf16p") else 4.0
    base = name.removesuffix("-bf16p")
    flat = base.endswith("-flat")
    # `-nativehop` (HSDP, `shard_hop="native"`): the same codes cross nodes, made once from the
    # shard FSDP2 reduced inside the node (its loopback bytes are in the measured compute)
    base = base.removesuffix("-flat").removesuffix("-nativehop")
    layout = {"ddp": "ddp", "fsdp2": "fsdp", "hsdp": "hsdp"}[path]
    if base in ("fp32", "bf16"):
        ex = {"ddp": "ddp_ring", "fsdp": "ring", "hsdp": "hsdp_ring"}[layout] + base[-2:]
        return ArmSpec(layout, ex), None, pbytes
    if base.startswith("powersgd-"):
        return ArmSpec("ddp", "powersgd"), {"rank": int(base.split("-")[1])}, pbytes
    fields = recipes.recipe_fields("muon-int2-leaky-ef" if base.startswith("euclid-int2") else base)
    codec = "euclid" if base.startswith("euclid") else "gift"
    ex = {"ddp": "ddp_a2a" if flat else "ddp_two_level", "fsdp": "a2a" if flat else "two_level",
          "hsdp": "hsdp_a2a"}[layout]
    return ArmSpec(layout, ex, codec), fields, pbytes


def emulated_link(spec: ArmSpec, fields: dict | None, pbytes: float, sh: Shapes, n: int, g: int,
                  x: dict[str, Any]) -> tuple[float, float, float, int | list[float]]:
    """Bytes one node sends across nodes per step for an emulated arm: (forward all-gathers,
    backward all-gathers, gradient exchange) and its overlap units (FSDP's, or DDP's bucket
    shares). The node's fast link (loopback) is inside the measured compute; the same rules as
    `price_arm`."""
    w = n * g
    units = sh.n_layers + 1
    ag = (w - 1) / w * pbytes * sh.params if spec.layout == "fsdp" else 0.0
    ex = spec.exchange
    buckets = ddp_shares(4.0 * sh.params, x)  # DDP buckets the fp32 gradient, whatever then travels
    if ex.startswith("ddp_ring") or ex.startswith("ring") or ex.startswith("hsdp_ring"):
        s = (4.0 if ex.endswith("32") else 2.0) * sh.params
        if ex.startswith("ddp_ring"):
            return 0.0, 0.0, 2 * (w - 1) / w * s, buckets
        if ex.startswith("ring"):
            return ag, ag, (w - 1) / w * s, units
        return 0.0, 0.0, 2 * (n - 1) / n * s, units  # HSDP: each of the g ranks all-reduces its 1/g shard
    if ex == "powersgd":
        s, _ = psgd_bytes_and_flops(sh, int(fields["rank"]), _v(x["powersgd_min_compression_rate"]))
        return 0.0, 0.0, 2 * (w - 1) / w * s, buckets
    codes = codes_bytes(sh, format_bits(fields), x)
    if ex == "a2a":
        return ag, ag, g * codes * (w - g) / w, units
    if ex == "two_level":
        return ag, ag, g * (n - 1) / n * codes / g, units
    if ex == "ddp_a2a":  # GIFT's all-reduce: all-to-all of the codes, all-gather of the reduced shard
        return 0.0, 0.0, 2 * g * codes * (w - g) / w, buckets
    if ex in ("ddp_two_level", "hsdp_a2a"):
        return 0.0, 0.0, 2 * g * (n - 1) / n * codes / g, buckets if ex.startswith("ddp") else units
    raise ValueError(f"step model: no emulated structure for exchange {ex!r}")


# Whether a path's collectives overlap the backward on the emulated cluster (a CPU device). DDP's
# reducer launches each bucket's all-reduce asynchronously (gloo work, a comm hook's future) and
# GIFT's DDP hook exchanges on its lane. FSDP2 (torch 2.13, `_fsdp_collectives.foreach_reduce`)
# calls its reduce-scatter without `async_op` and HSDP's all-reduce (or the all-reduce hook) in
# line, inside a stream context that is a no-op on a CPU: each FSDP unit's exchange blocks the
# backward, for every arm, native or GIFT. On GPUs FSDP2 runs them on their own streams (the
# regime tables' overlap).
EMULATED_OVERLAP = {"ddp": True, "fsdp2": False, "hsdp": False}


def refresh_link_bytes(rec: dict) -> float:
    """Bytes one node sends across nodes per timed step for GIFT's refresh (statistics, selection,
    map broadcast), from GIFT's own counter (`comm_totals()["refresh_cross_wire"]`, this rank's
    bytes handed to cross-node collectives over the timed steps): each of the node's g ranks hands
    them over, and (n-1)/n of what a rank hands to a collective over n nodes leaves its node. 0 for
    a run without the counter (native and PowerSGD arms, older results)."""
    gift = rec.get("gift_bytes") or {}
    handed = float(gift.get("refresh_cross_wire", 0.0))
    n, g = rec["nodes"], rec["g"]
    return g * handed * (n - 1) / n / timed_count(rec)


def predict_emulated(rec: dict, unshaped: dict, sh: Shapes, x: dict[str, Any], overlapped: bool) -> dict[str, Any]:
    """The model's step time for a shaped emulated-cluster run from the same arm's unshaped run
    (its whole measured step: compute, codec, statistics, loopback) and the link's rate; the
    payload a node sends per step (the kernel's count on the veth carries ~0.3% more: it counts
    the headers of GSO segments, not of 1500-byte frames; tc's shaper counts frames). The
    exchange overlaps the backward where the path does (`EMULATED_OVERLAP`; GIFT's only where
    `overlapped` too); the refresh's bytes (`refresh_link_bytes`) travel at the optimizer step,
    exposed."""
    spec, fields, pbytes = emulated_arm(rec["arm"], rec["path"])
    n, g = rec["nodes"], rec["g"]
    ag_f, ag_b, grad, units = emulated_link(spec, fields, pbytes, sh, n, g, x)
    refresh = refresh_link_bytes(rec)
    rate = float(rec["rate_mbit"]) * 1e6 / 8 * TC_FRAME_EFFICIENCY  # bytes/s per node, each direction
    lat = rec["delay_ms"] * 1e-3 * (n - 1)
    compute = median_step(unshaped)
    fwd = compute * _v(x["forward_share"])
    calls = units if isinstance(units, int) else len(units)
    t_ag_f, t_ag_b = ag_f / rate + (calls * lat if ag_f else 0.0), ag_b / rate + (calls * lat if ag_b else 0.0)
    t_grad = grad / rate + calls * lat
    ov = EMULATED_OVERLAP[rec["path"]] and (overlapped or not spec.gift_code)
    forward = _phase(fwd, t_ag_f, calls, EMULATED_OVERLAP[rec["path"]]) if spec.allgathers else fwd
    backward = (_phase(compute - fwd, t_ag_b + t_grad, units) if ov
                else _phase(compute - fwd, t_ag_b, units, EMULATED_OVERLAP[rec["path"]]) + t_grad)
    counted = None
    if rec.get("link_bytes") and all(isinstance(b, dict) for b in rec["link_bytes"]):
        counted = statistics.fmean(b["tx"] for b in rec["link_bytes"]) / timed_count(rec)
    ci = median_ci(timed_steps(rec))
    return {"arm": rec["arm"], "path": rec["path"], "layout": f"{n}x{g}", "rate_mbit": rec["rate_mbit"],
            "unshaped_s": compute, "predicted_s": forward + backward + refresh / rate, "measured_s": median_step(rec),
            "measured_lo": ci["lo"], "measured_hi": ci["hi"],
            "predicted_link_bytes": ag_f + ag_b + grad + refresh, "counted_link_bytes": counted,
            "overlapped": ov}


def validate(results: dict, inputs: dict | None = None, overlapped: bool | None = None,
             formats: dict[str, float | None] | None = None) -> dict[str, Any]:
    """Predicted vs measured step time per arm, path, layout and link rate of an emulated-cluster
    results JSON: each shaped run predicted from its arm's unshaped run. `results["model"]` gives
    the cluster model's `TinyLlamaConfig` fields; `overlapped` (else the results JSON's
    `gift_overlapped`, else the inputs' switch) whether GIFT's exchange overlapped the backward in
    that code;
    `formats` (else the results JSON's keys, else the inputs) the bytes per element the measured
    code sent outside the map (`unmapped_matrix_bytes`, `unmanaged_bytes`)."""
    x = dict((inputs or load_inputs())["global"])
    config = model_config(results)
    for key in ("unmapped_matrix_bytes", "unmanaged_bytes"):  # what the measured code sent outside the map
        if key in results:
            x[key] = {"value": results[key]}
        if key in (formats or {}):
            x[key] = {"value": formats[key]}
    if overlapped is None:
        overlapped = bool(results.get("gift_overlapped", _v(x["gift_exchange_overlapped"])))
    m = results.get("model") if isinstance(results.get("model"), dict) else {}
    tokens = int(m.get("local_batch", 2) * m.get("seq_len", 64))  # statistics FLOPs only; inside the measured step
    sh = shapes(config, tokens, int(_v(x["refresh_every"])), int(_v(x["gift_rank"])))
    recs = records(results)
    base = {(r["arm"], r["path"], r["nodes"], r["g"]): r for r in recs if not r["rate_mbit"]}
    rows = []
    for r in recs:
        if not r["rate_mbit"]:
            continue
        u = base.get((r["arm"], r["path"], r["nodes"], r["g"]))
        if u is None:
            rows.append({"arm": r["arm"], "path": r["path"], "layout": f"{r['nodes']}x{r['g']}",
                         "rate_mbit": r["rate_mbit"], "measured_s": median_step(r), "predicted_s": None,
                         "note": "no unshaped run of this arm to calibrate its compute"})
            continue
        p = predict_emulated(r, u, sh, x, overlapped)
        p["error"] = p["predicted_s"] / p["measured_s"] - 1
        rows.append(p)
    scored = [r for r in rows if r.get("predicted_s") is not None]
    for r in scored:  # a prediction inside the measurement's own CI cannot be told apart from it
        r["inside_ci"] = r["measured_lo"] <= r["predicted_s"] <= r["measured_hi"]
    return {"rows": rows, "within": sum(abs(r["error"]) <= TOLERANCE for r in scored), "scored": len(scored),
            "inside_ci": sum(r["inside_ci"] for r in scored),
            "tolerance": TOLERANCE, "gift_overlapped": overlapped,
            "rule": "each shaped run predicted from the same arm's unshaped median step (compute, codec, statistics, "
                    "loopback), the tc rate x 1448/1514 (TCP payload per Ethernet frame), forward share "
                    f"{_v(x['forward_share']):.3f}, the refresh's bytes from GIFT's counter (exposed), the exchange "
                    "overlapped on DDP only (FSDP2 blocks in its backward on a CPU: EMULATED_OVERLAP), the "
                    "collective structure of bench/step_model/topology.py"}


def validation_table(v: dict) -> str:
    """The markdown table of `validate`'s result."""
    head = ["path", "layout", "link Mbit/s", "arm", "unshaped s", "predicted s", "measured s [95% CI]", "error",
            "predicted MB/node", "counted MB/node (kernel)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(v["rows"], key=lambda r: (r["path"], r["layout"], float(r["rate_mbit"]), r["arm"])):
        if r.get("predicted_s") is None:
            lines.append(f"| {r['path']} | {r['layout']} | {r['rate_mbit']:g} | {r['arm']} | | | {r['measured_s']:.3f} "
                         f"| {r['note']} | | |")
            continue
        counted = "" if r["counted_link_bytes"] is None else f"{r['counted_link_bytes'] / 1e6:.2f}"
        lines.append(f"| {r['path']} | {r['layout']} | {r['rate_mbit']:g} | {r['arm']} | {r['unshaped_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} [{r['measured_lo']:.3f}, {r['measured_hi']:.3f}]"
                     f"{'' if r['inside_ci'] else ' (outside)'} | {r['error']:+.0%} | "
                     f"{r['predicted_link_bytes'] / 1e6:.2f} | {counted} |")
    return "\n".join(lines + ["", f"{v['within']} of {v['scored']} within {v['tolerance']:.0%}, {v['inside_ci']} of "
                              f"{v['scored']} inside the measured median's 95% CI (order statistics over the timed "
                              f"steps); GIFT's exchange "
                              f"{'overlapped' if v['gift_overlapped'] else 'not overlapped'}; {v['rule']}."])


# ---------------------------------------------------------------------------------------------
# the pages


def _best(arms: dict, names: tuple[str, ...]) -> tuple[str, float]:
    """The fastest of `names` among the arms whose state fits a GPU."""
    fit = [a for a in names if arms[a]["fits"]] or list(names)
    name = min(fit, key=lambda a: arms[a]["step"])
    return name, arms[name]["step"]


def _rows(d: dict, setting: str, overlapped: bool = True) -> list[dict]:
    return [r for r in d["rows"] if r["setting"] == setting and r["gift_overlapped"] == overlapped]


def _cell(a: dict) -> str:
    return f"{a['step'] * 1e3:,.0f}" + ("" if a["fits"] else " (n/f)")


def regime_table(d: dict, setting: str) -> str:
    """Step ms per arm, model, network and node count at one setting (GIFT overlapped), with the
    best GIFT arm against the best bf16 arm (ring or HSDP) and against the best Euclidean arm, and
    GIFT's best with its exchange not overlapped."""
    head = ["model", "network", "nodes x g", *ARMS, "GIFT best vs best bf16 arm", "GIFT best vs Euclidean best",
            "GIFT best, not overlapped, vs best bf16 arm"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    off = {(r["model"], r["network"], r["nodes"]): r for r in _rows(d, setting, False)}
    for r in _rows(d, setting):
        a = r["arms"]
        _, gift = _best(a, GIFT_ARMS)
        _, euc = _best(a, EUCLID_ARMS)
        _, gift_off = _best(off[r["model"], r["network"], r["nodes"]]["arms"], GIFT_ARMS)
        _, bf16 = _best(a, BASELINES)
        lines.append("| " + " | ".join([r["model"], r["network"], f"{r['nodes']} x {r['gpus_per_node']}",
                                         *(_cell(a[n]) for n in ARMS), f"{gift / bf16 - 1:+.1%}",
                                         f"{gift / euc - 1:+.1%}", f"{gift_off / bf16 - 1:+.1%}"]) + " |")
    return "\n".join(lines)


def _bits_text(d: dict) -> str:
    fb = d["bits_from_frontier"]
    return (f"equal bits: every low-bit arm at GIFT's fewest bits within fp32's noise on the frontier "
            f"({fb['gift']['bits']:.2f} bits per matrix element, `{fb['gift']['arm']}`, {d['optimizer']}); equal "
            f"quality: GIFT there, the Euclidean arms at Euclidean's own fewest bits within fp32's noise "
            f"({fb['euclid']['bits']:.2f}, `{fb['euclid']['arm']}`)")


def paper_text(d: dict) -> str:
    p = d["paper"]
    o, n = p["overlapped"], p["nothing overlapped"]
    return (f"{p['model']} on {p['nodes'] * p['gpus_per_node']} GH200 ({p['nodes']} nodes x {p['gpus_per_node']}, "
            f"{p['network']}; the all-reduce, FP8 E5M2 per tensor, the map on 13 fc2 layers): GIFT "
            f"{o['gift_vs_fp32']:+.1%} against FP32 (the paper: {p['paper_gift_vs_fp32']:+.1%}), Euclidean FP8 "
            f"{o['euclid_vs_fp32']:+.1%} (the paper: {p['paper_euclid_vs_fp32']:+.1%}), GIFT against Euclidean FP8 "
            f"{o['gift_vs_euclid']:+.1%}, with the all-reduce overlapped with the backward; with nothing overlapped "
            f"GIFT {n['gift_vs_fp32']:+.1%} and Euclidean {n['euclid_vs_fp32']:+.1%} against FP32 (GIFT against "
            f"Euclidean {n['gift_vs_euclid']:+.1%})")


def block(_: dict | None = None, path: Path = OUT) -> str:
    """The docs/benchmarks.md block: the regime tables at equal bits and at equal quality."""
    d = json.loads(path.read_text())
    inputs = "; ".join(f"`{w}` = {json.dumps(e['value'])} ({e['kind']})" for w, e in _inputs(d["inputs"]))
    return "\n".join([
        "Step time in ms per optimizer step by the step model (`bench/step_model/topology.py`; its structure, the rules "
        "every arm is priced by, is its docstring): compute from a cited MFU, FSDP's parameter all-gathers in the "
        "forward and the backward of every FSDP arm (HSDP's inside the node), one efficiency per network for rings "
        "and all-to-alls, communication overlapped with the backward as FSDP2 and DDP do it (GIFT's codec and "
        "statistics on the compute stream), two-level stages pipelined. "
        f"{_bits_text(d)}. (n/f): the arm's model state does not fit one GPU's memory. The last column: GIFT's "
        "exchange waiting inside the backward (GIFT's code before its exchange overlapped the backward).", "",
        "**Equal bits**", "", regime_table(d, "equal bits"), "",
        "**Equal quality**", "", regime_table(d, "equal quality"), "",
        f"**The paper's setting**: {paper_text(d)}.", "",
        f"Inputs, each with its command or public source in [{d['inputs_file']}](../{d['inputs_file']}): {inputs}.", "",
        f"Regenerate: `{d['command']}` then `python -m bench.pages.readme`; validate on an emulated-cluster run: "
        f"`{d['command']} --validate bench/results/cluster/<file>.json`."])


def _span(vs: list[float]) -> str:
    lo, hi = min(vs), max(vs)
    return f"{lo:+.0%}" if f"{lo:+.0%}" == f"{hi:+.0%}" else f"{lo:+.0%} to {hi:+.0%}"


def when_it_pays(_: dict | None = None, path: Path = OUT) -> str:
    """The README block: per model and network, GIFT's best arm against the best bf16 arm (ring
    or HSDP) and against the best Euclidean arm at equal quality (ranges over node counts), and
    the paper's setting."""
    d = json.loads(path.read_text())
    groups: dict[tuple[str, str], list[tuple[float, float, str, int, int]]] = {}
    for r in _rows(d, "equal quality"):
        a = r["arms"]
        name, gift = _best(a, GIFT_ARMS)
        _, euc = _best(a, EUCLID_ARMS)
        _, bf16 = _best(a, BASELINES)
        groups.setdefault((r["model"], r["network"]), []).append(
            (gift / bf16 - 1, gift / euc - 1, name, r["nodes"], r["gpus_per_node"]))
    lines = []
    for (model, net), vs in groups.items():
        bf = [v[0] for v in vs]
        names = " or ".join(sorted({v[2] for v in vs}))
        nodes = "/".join(str(v[3]) for v in vs)
        verdict = "pays" if max(bf) < 0 else "does not pay" if min(bf) >= 0 else "pays at some node counts"
        lines.append(f"* {verdict}: {model} on {net} ({nodes} nodes x {vs[0][4]}): {names} {_span(bf)} against the "
                     f"best bf16 arm, {_span([v[1] for v in vs])} against the best Euclidean arm")
    return "\n".join([
        "The step model (`bench/step_model/topology.py`; `--validate` sets it against an emulated-cluster run): FSDP's "
        "all-gathers in every FSDP arm, one efficiency per network, communication overlapped with the backward as "
        "FSDP2 does it (GIFT's codec, at its launch-bound wall time, and its statistics exposed on the compute "
        "stream), compute from a cited MFU. GIFT's best arm (flat, two-level, or HSDP with GIFT on the replica hop) "
        "against the best bf16 arm (ring reduce-scatter or HSDP) and the best Euclidean arm at equal quality; "
        + _bits_text(d) + ":", "",
        *lines, "",
        f"* the paper's setting: {paper_text(d)}.", "",
        f"Per arm, node count, equal bits and not overlapped: [docs/benchmarks.md](docs/benchmarks.md#step-time-by-topology); "
        f"`{d['command']} && python -m bench.pages.readme`."])


def plot(d: dict, out: Path = PLOT) -> None:
    """Step time per arm against node count on each network, Llama-3-8B, equal quality."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = [e["name"] for e in d["inputs"]["networks"]]
    fig, axes = plt.subplots(1, len(nets), figsize=(4 * len(nets), 4))
    for ax, net in zip(axes, nets):
        pts = [r for r in _rows(d, "equal quality") if r["model"] == "Llama-3-8B" and r["network"] == net]
        for arm in ARMS:
            ax.plot([p["nodes"] for p in pts], [p["arms"][arm]["step"] for p in pts], marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("step time, s")
        ax.set_title(net, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _rounded(d: Any) -> Any:
    """`d` with every float at 6 significant digits (the committed file stays readable)."""
    if isinstance(d, float):
        return float(f"{d:.6g}")
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_rounded(v) for v in d]
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--validate", type=Path, help="an emulated-cluster results JSON: print predicted vs measured")
    p.add_argument("--unmapped-matrix-bytes", type=float,
                   help="with --validate: bytes per element the measured code sent for matrices outside GIFT's map "
                        "(4: fp32, the code before the whole-gradient compression; default: at the arm's bits)")
    p.add_argument("--vector-bytes", type=float,
                   help="with --validate: bytes per element of vectors (norms, biases) in the measured code "
                        "(default: the inputs' unmanaged_bytes)")
    p.add_argument("--gift-overlapped", choices=("yes", "no"),
                   help="with --validate: whether GIFT's exchange overlapped the backward in the measured code "
                        "(default: the results JSON's gift_overlapped, else the inputs' switch)")
    a = p.parse_args(argv)
    if a.validate:
        ov = None if a.gift_overlapped is None else a.gift_overlapped == "yes"
        formats = {k: v for k, v in (("unmapped_matrix_bytes", a.unmapped_matrix_bytes),
                                     ("unmanaged_bytes", a.vector_bytes)) if v is not None}
        v = validate(json.loads(a.validate.read_text()), overlapped=ov, formats=formats)
        print(validation_table(v))
        return 0
    d = run()
    a.out.write_text(json.dumps(_rounded(d), indent=1) + "\n")
    plot(d)
    print(block(path=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
