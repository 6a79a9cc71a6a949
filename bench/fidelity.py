"""Fidelity: how much of the gradient survives one quantized collective, per format and geometry.

Three measurements on the reference model's real gradients (see `bench.reference`):

1. One round trip (transform, quantize, dequantize, inverse) through
   `gift_compile.collectives.all_reduce(g, None, config, transform)`, the product's own code
   path with no peers. Error is measured in original coordinates, per layer and
   energy-weighted over layers (`sqrt(sum ||E||^2 / sum ||G||^2)`), next to the Gaussian
   rate-distortion value at the same wire bits per element.
2. The same error resolved along the eigendirections of this batch's K-FAC factor `A`
   (the geometry the optimizer sees): Euclidean quantization noise is white, so its relative
   size grows in the weak directions of `A`; whitened noise should be flat. The whitened
   metric `||E T^T|| / ||G T^T||` (`T A T^T = I`) summarises it in one number.
3. P simulated ranks (P = 2, 8, 32), each with its own gradient (per-micro-batch gradients):
   our collective (scales agreed before encoding, codes decoded with those scales and summed
   in fp32; for an all-reduce, the summed shard re-quantized and all-gathered) against the
   original method (each rank encodes with its local scale, a collective sums the FP8 codes in
   FP8 with saturation, and a replica decodes the sum with its own scale).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch

from bench.reference import LayerSample
from bench.settings import FidelitySettings
from gift_compile.collectives import all_reduce
from gift_compile.config import GiftConfig
from gift_compile.formats import FormatSpec, as_rows, choose_scales, decode, encode
from gift_compile.geometry import Transform
from gift_compile.statistics import SketchStatistics

Log = Callable[[str], None]
# The two transforms the multi-rank experiment compares (cost grows with P x formats).
MULTIRANK_TRANSFORMS = ("euclidean", "kfac-r32")
_FP8_DTYPES = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def build_transform(kind: str, rank: int, source: str, sample: LayerSample, damping: float) -> Transform:
    """A `gift_compile.geometry.Transform` for `sample`, refreshed from the previous batch.

    `source` "kfac" whitens the K-FAC input factor, "kfac-sketch" the same factor seen only
    through its sketch (`sketched`; "kfac-sketch:K" with K sketch columns instead of the
    default 2 x rank), "grad" the gradient-side factor (GiftConfig(geometry="gradient")),
    "none" keeps the fixed map (identity, Hadamard).
    """
    t = Transform(kind, sample.shape[1], rank or 32, seed=0)
    source, _, cols = source.partition(":")
    if source == "kfac":
        t.refresh_from(sample.a_prev, damping)
    elif source == "kfac-sketch":
        t.refresh_from_stats(sketched(sample.a_prev, t.rank, int(cols) if cols else None), damping)
    elif source == "grad":
        t.refresh_from(sample.g_prev, damping)
    return t


def sketched(a: torch.Tensor, rank: int, cols: int | None = None) -> SketchStatistics:
    """`SketchStatistics` (`cols` columns, default 2 x rank) that has observed exactly `a`.

    The reference keeps each batch's `A` rather than its activations, so the sketch observes
    `d` stand-in tokens `sqrt(d) A^{1/2}` whose second moment is `A`: the sketch and diagonal
    it accumulates (`A Omega`, `diag A`, in fp32 like a real stream) are those of the real
    tokens, and any difference to the `kfac` transform is the sketch's alone.
    """
    d = a.shape[0]
    lam, u = torch.linalg.eigh(0.5 * (a.double() + a.double().t()))
    tokens = (u * lam.clamp(min=0.0).sqrt()) @ u.t() * math.sqrt(d)
    stats = SketchStatistics(d, rank=rank, sketch_cols=cols, ema=0.0, max_tokens=d)
    stats.observe(tokens.float())
    stats.consolidate(None)
    return stats


def rate_distortion_bound(bits: float) -> float:
    """Relative L2 error of an ideal `bits`-per-element code of an i.i.d. Gaussian source.

    `D(R) = sigma^2 2^{-2R}` in MSE, i.e. `2^{-R}` relative L2. The Gaussian is the hardest
    source at a given variance, so an ideal code would do at least this well on any
    gradient: the gap to it is what scalar floating-point formats leave on the table.
    """
    return 2.0 ** (-bits)


class _EigenBasis:
    """Eigenbasis of a sample's current K-FAC factor, for direction-resolved errors."""

    def __init__(self, a: torch.Tensor, buckets: int, damping: float) -> None:
        a64 = 0.5 * (a.double() + a.double().t())
        lam, u = torch.linalg.eigh(a64)
        self.lam = lam.flip(0).clamp(min=0.0)  # descending
        self.u = u.flip(1)
        floor = damping * float(torch.diagonal(a64).mean())
        self.inv = 1.0 / (self.lam + max(floor, 1e-30))
        d = self.lam.numel()
        self.bucket = torch.div(torch.arange(d) * buckets, d, rounding_mode="floor")
        self.buckets = buckets

    def energies(self, m: torch.Tensor) -> torch.Tensor:
        """`||m u_k||^2` for every eigendirection `u_k` (descending eigenvalue)."""
        return (m.double() @ self.u).pow(2).sum(dim=0)

    def per_bucket(self, e: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.buckets, dtype=torch.float64).index_add_(0, self.bucket, e)


def _config(fmt: str, scaling: str) -> GiftConfig:
    return GiftConfig(format=fmt, scaling=scaling, select="all")


def round_trip_errors(
    samples: list[LayerSample],
    formats: tuple[tuple[str, str, str], ...],
    transforms: tuple[tuple[str, str, int, str], ...],
    s: FidelitySettings,
    log: Log,
) -> dict[str, object]:
    """Measurements 1 and 2 (single round trip; eigendirection-resolved and whitened)."""
    err = defaultdict(float)  # (fmt, tr) -> sum ||E||^2
    ref = 0.0
    werr = defaultdict(float)  # whitened
    wref = 0.0
    layer_err: dict[tuple[str, str, str], float] = defaultdict(float)
    layer_ref: dict[str, float] = defaultdict(float)
    layer_werr: dict[tuple[str, str, str], float] = defaultdict(float)
    layer_wref: dict[str, float] = defaultdict(float)
    bucket_err: dict[tuple[str, str], torch.Tensor] = {}
    bucket_ref = torch.zeros(s.eigen_buckets, dtype=torch.float64)
    configs = {label: _config(fmt, sc) for label, fmt, sc in formats}
    for i, sample in enumerate(samples):
        g = sample.grad
        basis = _EigenBasis(sample.a_cur, s.eigen_buckets, s.damping)
        g_e = basis.energies(g)
        gref = float(g.double().pow(2).sum())
        ref += gref
        layer_ref[sample.name] += gref
        g_w = float((g_e * basis.inv).sum())
        wref += g_w
        layer_wref[sample.name] += g_w
        bucket_ref += basis.per_bucket(g_e)
        for tlabel, kind, rank, source in transforms:
            transform = build_transform(kind, rank, source, sample, s.damping)
            for flabel, config in configs.items():
                e = all_reduce(g, None, config, transform) - g
                e2 = float(e.double().pow(2).sum())
                key = (flabel, tlabel)
                err[key] += e2
                layer_err[(flabel, tlabel, sample.name)] += e2
                e_e = basis.energies(e)
                e_w = float((e_e * basis.inv).sum())
                werr[key] += e_w
                layer_werr[(flabel, tlabel, sample.name)] += e_w
                bucket_err[key] = bucket_err.get(key, torch.zeros_like(bucket_ref)) + basis.per_bucket(e_e)
        if (i + 1) % max(1, len(samples) // 4) == 0 or i + 1 == len(samples):
            log(f"  round trips: {i + 1}/{len(samples)} layer samples")
    flabels = [f[0] for f in formats]
    tlabels = [t[0] for t in transforms]
    layers = list(dict.fromkeys(x.name for x in samples))
    return {
        "energy_weighted": {f: {t: math.sqrt(err[(f, t)] / ref) for t in tlabels} for f in flabels},
        "whitened": {f: {t: math.sqrt(werr[(f, t)] / wref) for t in tlabels} for f in flabels},
        "per_layer": {
            f: {t: {n: math.sqrt(layer_err[(f, t, n)] / layer_ref[n]) for n in layers} for t in tlabels}
            for f in flabels
        },
        "per_layer_whitened": {
            f: {t: {n: math.sqrt(layer_werr[(f, t, n)] / layer_wref[n]) for n in layers} for t in tlabels}
            for f in flabels
        },
        "eigen_buckets": {
            f: {t: (bucket_err[(f, t)] / bucket_ref).sqrt().tolist() for t in tlabels} for f in flabels
        },
    }


def bits_per_element(samples: list[LayerSample], formats: tuple[tuple[str, str, str], ...]) -> dict[str, float]:
    """Exact wire bits per element of each format over the managed layers (scales included)."""
    shapes = {x.name: x.shape for x in samples}
    numel = sum(r * c for r, c in shapes.values())
    out = {}
    for label, fmt, sc in formats:
        spec = FormatSpec(fmt, sc)
        out[label] = sum(spec.bits_per_element(c, r) * r * c for r, c in shapes.values()) / numel
    return out


class _Agreement:
    """Stand-in for the scale all-reduce MAX inside `choose_scales`, for simulated ranks.

    Returns the already agreed value for the calls that have one and records the rest; see
    `agreed_scales`.
    """

    def __init__(self, known: list[torch.Tensor]) -> None:
        self.known = known
        self.seen: list[torch.Tensor] = []

    def __call__(self, stat: torch.Tensor) -> torch.Tensor:
        k = len(self.seen)
        self.seen.append(stat)
        return self.known[k] if k < len(self.known) else stat


def agreed_scales(xs: list[torch.Tensor], spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scales every rank computes in `gift_compile.collectives` for local tensors `xs`.

    `choose_scales` may agree on several statistics in sequence (nvfp4: the tensor scale,
    then block-scale codes that depend on it). Each pass runs every simulated rank through
    the library's own `choose_scales` and settles one more statistic as the element-wise
    maximum over ranks, exactly what the all-reduce MAX delivers.
    """
    known: list[torch.Tensor] = []
    while True:
        calls = [_Agreement(known) for _ in xs]
        results = [choose_scales(x, spec, c) for x, c in zip(xs, calls)]
        k = len(known)
        if len(calls[0].seen) == k:
            return results[0]
        known.append(torch.stack([c.seen[k] for c in calls]).amax(dim=0))


def _ours(xs: list[torch.Tensor], spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Our collective on simulated ranks: `(reduce-scatter result, all-reduce result)`.

    Reduce-scatter: agreed scales, every rank's codes decoded with them, fp32 sum, mean. The
    all-reduce then re-quantizes each rank's row shard of that sum with the shard's own
    scales and every rank decodes the gathered shards.
    """
    p = len(xs)
    cols = xs[0].shape[-1]
    scales, tscale = agreed_scales(xs, spec)
    total = sum(decode(encode(x, spec, scales, tscale), spec, scales, tscale, cols) for x in xs) / p
    rows = total.shape[0]
    padded = torch.nn.functional.pad(total, (0, 0, 0, (-rows) % p))
    shards = []
    for shard in padded.chunk(p, dim=0):
        sc, ts = choose_scales(shard, spec)
        shards.append(decode(encode(shard, spec, sc, ts), spec, sc, ts, cols))
    return total, torch.cat(shards)[:rows]


def _original(xs: list[torch.Tensor], spec: FormatSpec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The original method: local scales, FP8 codes summed in FP8 (saturating), per-replica decode.

    Each rank encodes with the scale of its own amax; the collective adds the codes as FP8
    numbers in ring order (each partial sum computed exactly, then rounded to FP8 and clamped
    at the format's maximum: saturation is the kindest overflow behaviour a reduction can
    have, the alternative being NaN); replica `r` decodes the summed codes with its own
    scale. Returns replica 0's mean and every replica's.
    """
    dtype, fmax = _FP8_DTYPES[spec.name]
    local = [choose_scales(x, spec) for x in xs]
    codes = [encode(x, spec, sc, None).view(dtype).float() for x, (sc, _) in zip(xs, local)]
    acc = codes[0]
    for c in codes[1:]:
        acc = (acc + c).clamp(-fmax, fmax).to(dtype).float()
    payload = acc.to(dtype).view(torch.uint8)
    cols = xs[0].shape[-1]
    replicas = [decode(payload, spec, sc, None, cols) / len(xs) for sc, _ in local]
    return replicas[0], replicas


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm().clamp(min=1e-30))


def multirank_errors(
    samples: list[LayerSample],
    formats: tuple[tuple[str, str, str], ...],
    transforms: tuple[tuple[str, str, int, str], ...],
    s: FidelitySettings,
    log: Log,
) -> dict[str, object]:
    """Measurement 3: energy-weighted relative error of the mean over P simulated ranks."""
    chosen = [t for t in transforms if t[0] in MULTIRANK_TRANSFORMS]
    with_micro = [x for x in samples if x.micro is not None]
    acc: dict[tuple[int, str, str, str], float] = defaultdict(float)
    ref: dict[int, float] = defaultdict(float)
    for i, sample in enumerate(with_micro):
        m = sample.micro.shape[0]
        for p in s.ranks:
            if m % p:
                raise ValueError(f"{m} micro-batches cannot be split over {p} simulated ranks")
            per_rank = sample.micro.reshape(p, m // p, *sample.shape).mean(dim=1)
            target = per_rank.mean(dim=0)
            tref = float(target.double().pow(2).sum())
            ref[p] += tref
            for tlabel, kind, rank, source in chosen:
                transform = build_transform(kind, rank, source, sample, s.damping)
                xs = [as_rows(transform.forward(g)) for g in per_rank]
                for flabel, fmt, sc in formats:
                    spec = FormatSpec(fmt, sc)
                    rs, ar = _ours(xs, spec)
                    key = (p, flabel, tlabel)
                    acc[key + ("ours_reduce_scatter",)] += _rel(transform.inverse(rs), target) ** 2 * tref
                    acc[key + ("ours_all_reduce",)] += _rel(transform.inverse(ar), target) ** 2 * tref
                    if fmt in _FP8_DTYPES:
                        first, replicas = _original(xs, spec)
                        base = transform.inverse(first)
                        acc[key + ("original",)] += _rel(base, target) ** 2 * tref
                        # how far apart the replicas' "reduced" gradients are, relative to ||target||
                        spread2 = max(float((transform.inverse(r) - base).double().pow(2).sum()) for r in replicas)
                        acc[key + ("replica_spread",)] += spread2
        if (i + 1) % max(1, len(with_micro) // 4) == 0 or i + 1 == len(with_micro):
            log(f"  multi-rank: {i + 1}/{len(with_micro)} layer samples (P = {', '.join(map(str, s.ranks))})")
    out: dict[str, object] = {}
    for p in s.ranks:
        out[str(p)] = {
            f: {
                t: {what: math.sqrt(acc[(p, f, t, what)] / ref[p])
                    for what in ("ours_reduce_scatter", "ours_all_reduce", "original", "replica_spread")
                    if (p, f, t, what) in acc}
                for t, *_ in chosen
            }
            for f, *_ in formats
        }
    return out


def run(
    samples: list[LayerSample],
    formats: tuple[tuple[str, str, str], ...],
    transforms: tuple[tuple[str, str, int, str], ...],
    s: FidelitySettings,
    log: Log,
) -> dict[str, object]:
    """All fidelity measurements as one JSON-ready dict."""
    bits = bits_per_element(samples, formats)
    result: dict[str, object] = {
        "formats": [f[0] for f in formats],
        "transforms": [t[0] for t in transforms],
        "layers": list(dict.fromkeys(x.name for x in samples)),
        "batches": len({x.batch for x in samples}),
        "bits_per_element": bits,
        "rd_bound": {f: rate_distortion_bound(b) for f, b in bits.items()},
    }
    result.update(round_trip_errors(samples, formats, transforms, s, log))
    result["multirank"] = multirank_errors(samples, formats, transforms, s, log)
    return result
