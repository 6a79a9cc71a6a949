"""Fidelity: how much of the gradient survives one quantized collective, per format and geometry.

Three measurements on the reference model's real gradients (see `bench.lib.reference`):

1. One round trip (transform, quantize, dequantize, inverse) through
   `gift_compile.exchange.collectives.all_reduce(g, None, config, transform)`, the product's own code
   path with no peers. Error is measured in original coordinates, per layer and
   energy-weighted over layers (`sqrt(sum ||E||^2 / sum ||G||^2)`), next to the Gaussian
   rate-distortion value at the same wire bits per element.
2. The same error resolved along the eigendirections of this batch's K-FAC factor `A`
   (the geometry a K-FAC-style preconditioner sees): Euclidean quantization noise is white,
   so its relative size grows in the weak directions of `A`; whitened noise should be flat.
   The whitened metric `||E T^T|| / ||G T^T||` (`T A T^T = I`) summarises it in one number.
   The Muon metric is the error of the update Muon would take from this gradient alone:
   `||NS(G + E) - NS(G)|| / ||NS(G)||` with `NS` torch.optim.Muon's Newton-Schulz
   orthogonalization (its coefficients and step count, in fp64), which equalizes the
   gradient's singular values and so amplifies noise in its weak singular directions.
3. P simulated ranks (P = 2, 8, 32), each with its own gradient (per-micro-batch gradients):
   our collective exactly as `gift_compile.exchange.collectives` runs it (each rank encodes with its
   own local scales, every sender's codes are decoded with that sender's scales and summed in
   fp32; for an all-reduce, each summed shard is re-quantized and all-gathered) against two
   in-network FP8 sums, where the collective adds the codes themselves in FP8 (each partial
   sum rounded to FP8, saturating): with ONE scale agreed by every rank beforehand (the fair
   form of that design; optionally with P-fold headroom so the sum cannot saturate), and with
   each rank's local scale (the original method, whose replicas then decode different values).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch
from torch.optim import _muon

from bench.lib.reference import LayerSample
from bench.lib.settings import FidelitySettings
from gift_compile.codec import FormatSpec, as_rows, choose_scales, decode, encode
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import all_reduce
from gift_compile.geometry import Transform, gradient_factor
from gift_compile.geometry.statistics import SketchStatistics

Log = Callable[[str], None]
# The two transforms the multi-rank experiment compares (cost grows with P x formats).
MULTIRANK_TRANSFORMS = ("euclidean", "kfac-r32")
# What the multi-rank experiment reports per (P, format, transform); see `multirank_errors`.
MULTIRANK_METHODS = ("ours_reduce_scatter", "ours_all_reduce", "agreed_in_network", "agreed_in_network_headroom",
                     "original", "replica_spread")
_FP8_DTYPES = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def build_transform(kind: str, rank: int, source: str, sample: LayerSample, damping: float) -> Transform:
    """A `gift_compile.geometry.Transform` for `sample`, refreshed from the previous batch.

    `source` "kfac" whitens the K-FAC input factor, "kfac-sketch" the same factor seen only
    through its sketch (`sketched`; "kfac-sketch:K" with K sketch columns instead of the
    default 2 x rank), "grad" the gradient-side factor (GiftConfig(geometry="gradient")),
    "none" keeps the fixed map (identity, Hadamard). "kfac-cur" / "grad-cur" build the map
    from this batch's own factor instead of the previous batch's: an oracle without staleness,
    the upper bound of what a fresher refresh could give. A suffix "@D" overrides `damping`.
    """
    t = Transform(kind, sample.shape[1], rank or 32, seed=0)
    source, _, damp = source.partition("@")
    damping = float(damp) if damp else damping
    source, _, cols = source.partition(":")
    if source == "kfac":
        t.refresh_from(sample.a_prev, damping)
    elif source == "kfac-cur":
        t.refresh_from(sample.a_cur, damping)
    elif source == "kfac-sketch":
        t.refresh_from_stats(sketched(sample.a_prev, t.rank, int(cols) if cols else None), damping)
    elif source == "grad":
        t.refresh_from(sample.g_prev, damping)
    elif source == "grad-cur":
        t.refresh_from(gradient_factor(sample.grad), damping)
    elif source != "none":
        raise ValueError(f"unknown transform source {source!r}; allowed: none, kfac, kfac-cur, kfac-sketch[:K], "
                         "grad, grad-cur (each optionally @damping)")
    return t


def two_sided_round_trip(g: torch.Tensor, left: Transform, right: Transform,
                         reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`g` whitened on both sides (rows by `left`, columns by `right`: L^-1 G R^-T), sent
    through `reduce` (a Euclidean quantized collective) and mapped back. The two-sided
    experiment of `fidelity_sweep` (`mom2-*`) and the convergence bench (`-two`)."""
    coded = left.forward(right.forward(g).t()).t().contiguous()
    return right.inverse(left.inverse(reduce(coded).t()).t())


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


def muon_direction(g: torch.Tensor) -> torch.Tensor:
    """Muon's update direction for gradient `g`: torch.optim.Muon's Newton-Schulz iteration.

    Same quintic coefficients, step count and normalisation as the optimizer (imported from
    it, so the metric follows torch), computed in fp32 instead of Muon's bf16 so that the
    metric measures the map's sensitivity to the communication error (>= 1e-3 here), not
    bf16 rounding (~4e-3). The iteration pushes every singular value towards ~1, multiplying
    weak singular directions by up to a^steps (~480): the noise Muon amplifies.
    """
    a, b, c = _muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / x.norm().clamp(min=_muon.EPS)
    for _ in range(_muon.DEFAULT_NS_STEPS):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.t() if tall else x).double()


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
    return GiftConfig(format=fmt, scaling=scaling, geometry="lowrank", select="all")


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
    merr = defaultdict(float)  # Muon metric
    mref = 0.0
    layer_merr: dict[tuple[str, str, str], float] = defaultdict(float)
    layer_mref: dict[str, float] = defaultdict(float)
    bucket_err: dict[tuple[str, str], torch.Tensor] = {}
    bucket_ref = torch.zeros(s.eigen_buckets, dtype=torch.float64)
    configs = {label: _config(fmt, sc) for label, fmt, sc in formats}
    for i, sample in enumerate(samples):
        g = sample.grad
        o = muon_direction(g)
        o2 = float(o.pow(2).sum())
        mref += o2
        layer_mref[sample.name] += o2
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
                got = all_reduce(g, None, config, transform)
                e = got - g
                e2 = float(e.double().pow(2).sum())
                m2 = float((muon_direction(got) - o).pow(2).sum())
                merr[(flabel, tlabel)] += m2
                layer_merr[(flabel, tlabel, sample.name)] += m2
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
        "muon": {f: {t: math.sqrt(merr[(f, t)] / mref) for t in tlabels} for f in flabels},
        "per_layer": {
            f: {t: {n: math.sqrt(layer_err[(f, t, n)] / layer_ref[n]) for n in layers} for t in tlabels}
            for f in flabels
        },
        "per_layer_whitened": {
            f: {t: {n: math.sqrt(layer_werr[(f, t, n)] / layer_wref[n]) for n in layers} for t in tlabels}
            for f in flabels
        },
        "per_layer_muon": {
            f: {t: {n: math.sqrt(layer_merr[(f, t, n)] / layer_mref[n]) for n in layers} for t in tlabels}
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
    """The scales every rank computes in `gift_compile.exchange.collectives` for local tensors `xs`.

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
    """Our collective on simulated ranks, as `gift_compile.exchange.collectives` runs it:
    `(reduce-scatter result, all-reduce result)`.

    Reduce-scatter: each rank encodes with its own local scales, every sender's codes are
    decoded with that sender's scales, summed in fp32 and averaged. The all-reduce then
    re-quantizes each rank's row shard of that sum with the shard's own scales and every rank
    decodes the gathered shards (the same bytes everywhere).
    """
    p = len(xs)
    cols = xs[0].shape[-1]
    total = 0
    for x in xs:
        sc, ts = choose_scales(x, spec)
        total = total + decode(encode(x, spec, sc, ts), spec, sc, ts, cols)
    total = total / p
    rows = total.shape[0]
    padded = torch.nn.functional.pad(total, (0, 0, 0, (-rows) % p))
    shards = []
    for shard in padded.chunk(p, dim=0):
        sc, ts = choose_scales(shard, spec)
        shards.append(decode(encode(shard, spec, sc, ts), spec, sc, ts, cols))
    return total, torch.cat(shards)[:rows]


def _fp8_code_sum(codes: list[torch.Tensor], spec: FormatSpec) -> torch.Tensor:
    """What an in-network FP8 reduction delivers: the codes added as FP8 numbers in ring
    order, each partial sum computed exactly, then rounded to FP8 and clamped at the format's
    maximum (saturation is the kindest overflow a reduction can have; the alternative is NaN).
    Returns the summed codes as uint8."""
    dtype, fmax = _FP8_DTYPES[spec.name]
    acc = codes[0].view(dtype).float()
    for c in codes[1:]:
        acc = (acc + c.view(dtype).float()).clamp(-fmax, fmax).to(dtype).float()
    return acc.to(dtype).view(torch.uint8)


def _in_network_agreed(xs: list[torch.Tensor], spec: FormatSpec, headroom: bool) -> torch.Tensor:
    """An in-network FP8 sum with ONE set of scales agreed by every rank before encoding.

    The scales are those of the element-wise largest statistic over ranks (an all-reduce MAX,
    `agreed_scales`), so every rank's codes live on the same grid and every replica decodes
    the summed codes with the same scale: replicas agree, and the only error left is FP8
    rounding of the inputs and of every partial sum, plus saturation. `headroom` multiplies
    the scales by P (exact: P is a power of two here) so that no partial sum can exceed the
    format's maximum, at the price of pushing small values P times closer to the subnormals.
    Returns the mean over ranks.
    """
    p = len(xs)
    scales, tscale = agreed_scales(xs, spec)
    if headroom:
        scales = scales * p
    summed = _fp8_code_sum([encode(x, spec, scales, tscale) for x in xs], spec)
    return decode(summed, spec, scales, tscale, xs[0].shape[-1]) / p


def _original(xs: list[torch.Tensor], spec: FormatSpec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The original method: local scales, FP8 codes summed in FP8 (saturating), per-replica decode.

    Each rank encodes with the scale of its own amax; the collective adds the codes
    (`_fp8_code_sum`); replica `r` decodes the summed codes with its own scale, so replicas
    disagree whenever the local scales do. Returns replica 0's mean and every replica's.
    """
    local = [choose_scales(x, spec) for x in xs]
    summed = _fp8_code_sum([encode(x, spec, sc, None) for x, (sc, _) in zip(xs, local)], spec)
    cols = xs[0].shape[-1]
    replicas = [decode(summed, spec, sc, None, cols) / len(xs) for sc, _ in local]
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
                        for what, headroom in (("agreed_in_network", False), ("agreed_in_network_headroom", True)):
                            agreed = transform.inverse(_in_network_agreed(xs, spec, headroom))
                            acc[key + (what,)] += _rel(agreed, target) ** 2 * tref
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
                    for what in MULTIRANK_METHODS
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
