"""The fast instrument for tuning GIFT: one round trip per (transform, format) on real gradients,
in the metrics that decide what an optimizer does with the error.

    python -m bench.fidelity.sweep [--reference adamw|muon] [--formats e4m3/row,nvfp4,...]
        [--transforms NAME,...] [--batches 8] [--out bench/results/fidelity/fidelity_sweep.json]

A convergence run costs minutes per arm and seed; this costs seconds per candidate, so it
proposes what the short paired runs (`bench.convergence.tune`) then judge. Metrics (relative errors,
energy-weighted over layers and batches):

- `plain`: ||E|| / ||G|| (what SGD sees);
- `whitened`: in the K-FAC geometry of this batch's A (what a K-FAC/Shampoo-style
  preconditioner sees; GIFT's design target);
- `muon`: the error of Muon's orthogonalized update of this gradient alone (`NS(G + E)` vs
  `NS(G)`, `bench.fidelity.round_trip.muon_direction`);
- `muon-mom`: the same for the update Muon really takes, from its Nesterov momentum: `U = w G
  + (1 - w) M` with M a momentum proxy (the mean gradient of the other held-out batches) and
  w = 1 - 0.95^2 (torch Muon's default momentum 0.95), so the error enters as `w E`;
- `adam`: ||E / sqrt(v)|| / ||G / sqrt(v)|| with v the mean squared gradient over the held-out
  batches (AdamW's elementwise preconditioner).

Candidates vary what could limit GIFT: the factor (K-FAC input factor A, the gradient-side
factor G^T G of the previous batch, or the momentum proxy's M^T M), rank or dense, the
sketch, damping, and staleness (`*-cur`: built from the measured batch itself, an oracle no
refresh can reach). The reference model is the bench's small Llama trained with AdamW or
with Muon (`--reference muon`, cached separately). Prints, per format, each candidate's error
and gain over Euclidean in every metric, and the `muon-mom` gain per layer kind; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from bench.fidelity import round_trip as fidelity
from bench.lib import reference
from bench.lib.reference import LayerSample
from bench.lib.settings import profile
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import all_reduce
from gift_compile.geometry import Transform, gradient_factor
from gift_compile.torchtitan_ext.cpu import corpus
from bench.lib.paths import RESULTS

# label -> (Transform kind, rank, source[@damping]); see `bench.fidelity.round_trip.build_transform`.
CANDIDATES: dict[str, tuple[str, int, str]] = {
    "euclidean": ("identity", 0, "none"),
    "hadamard": ("hadamard", 0, "none"),
    "kfac-r32": ("lowrank", 32, "kfac"),
    "kfac-sketch-r32": ("lowrank", 32, "kfac-sketch"),
    "kfac-r64": ("lowrank", 64, "kfac"),
    "kfac-dense": ("dense", 0, "kfac"),
    "kfac-r32-d1e-4": ("lowrank", 32, "kfac@1e-4"),
    "kfac-r32-d1e-2": ("lowrank", 32, "kfac@1e-2"),
    "kfac-r32-d1e-1": ("lowrank", 32, "kfac@1e-1"),
    "kfac-cur-r32": ("lowrank", 32, "kfac-cur"),
    "kfac-cur-dense": ("dense", 0, "kfac-cur"),
    "grad-r32": ("lowrank", 32, "grad"),
    "grad-r64": ("lowrank", 64, "grad"),
    "grad-dense": ("dense", 0, "grad"),
    "grad-dense-d1e-2": ("dense", 0, "grad@1e-2"),
    "grad-cur-r32": ("lowrank", 32, "grad-cur"),
    "grad-cur-dense": ("dense", 0, "grad-cur"),
    "mom-r8": ("lowrank", 8, "mom"),
    "mom-r16": ("lowrank", 16, "mom"),
    "mom-r32": ("lowrank", 32, "mom"),
    "mom-r32-d1e-2": ("lowrank", 32, "mom@1e-2"),
    "mom-r32-d1e-1": ("lowrank", 32, "mom@1e-1"),
    "mom-r64": ("lowrank", 64, "mom"),
    "mom-dense": ("dense", 0, "mom"),
    "mom-dense-d1e-2": ("dense", 0, "mom@1e-2"),
    # two-sided: the momentum's output-side factor M M^T / in whitens the rows as well
    # (not a GiftConfig geometry: a row-mixing map cannot be inverted on an FSDP row shard)
    "mom2-dense-d1e-2": ("dense", 0, "mom2@1e-2"),
    "mom2-cur-dense-d1e-2": ("dense", 0, "mom2-cur@1e-2"),
}
# AdamW geometry candidates (prototypes, not GiftConfig geometries): label -> what each sends.
# Each is built from what every rank could hold: the optimizer's state at the last refresh
# (`reference.optimizer_state`; under FSDP each rank holds a row shard of it, and the row/column
# sums below are one all-reduce of [out] + [in] numbers) and this batch's K-FAC factor source.
ADAM_CANDIDATES: dict[str, str] = {
    # the gradient scaled elementwise by vhat^(-p/2), vhat = r c^T / sum(r) the factored (Adafactor)
    # estimate of AdamW's second moment v (r, c its row and column sums): quantized in (a power of)
    # the coordinates AdamW's update m / sqrt(v) sees, mapped back by the inverse scaling
    "vfac-p1": "factored v, power 1 (AdamW's own coordinates)",
    "vfac-p0.5": "factored v, power 1/2",
    # only the column factor c^(-p/2): a diagonal map on the input dimension (a row factor is
    # constant along each row-wise scale block, so the format's block scales absorb most of it)
    "vcol-p1": "column factor of v only, power 1",
    # the same scaling, then GIFT's K-FAC low-rank whitening (rank 32) of the scaled gradient
    "vfac-p1+kfac-r32": "factored v power 1, then K-FAC r32",
    "vfac-p0.5+kfac-r32": "factored v power 1/2, then K-FAC r32",
    # the full elementwise v (no factoring): an upper bound; a sender would need v for every
    # element of its full gradient, which a sharded optimizer does not hold
    "vfull-p1": "full v, power 1 (oracle: not shardable)",
    # low-rank side channel: P = G V (V the top-r right singular vectors of AdamW's first moment m)
    # sent in bf16, the residual G - P V^T in the low-bit format; costs 16 r / cols extra bits/element
    "side-r4": "top-4 side channel of m in bf16 + low-bit residual",
    "side-r8": "top-8 side channel of m in bf16 + low-bit residual",
    "side-r8+vfac-p1": "top-8 side channel of m in bf16 + residual in factored-v coordinates",
    # random Hadamard rotation (random signs) with each rank's own signs: the 2-rank metrics
    # decode each sender with its signs, so first-hop errors of the ranks are decorrelated
    "hadamard-rank": "random Hadamard, per-rank signs",
}
# candidates no product could run: built from what a refresh cannot know (this batch's own
# statistics) or from state a sharded sender does not hold (the full elementwise v)
ORACLES = frozenset({"kfac-cur-r32", "kfac-cur-dense", "grad-cur-r32", "grad-cur-dense", "mom2-cur-dense-d1e-2",
                     "vfull-p1"})
# label -> (format, scaling) for the sweep's formats (the block formats ignore scaling)
SWEEP_FORMATS: dict[str, tuple[str, str]] = {
    "e4m3/row": ("fp8_e4m3", "row"),
    "e5m2/tensor": ("fp8_e5m2", "tensor"),
    "nvfp4": ("nvfp4", "row"),
    "int4": ("int4", "row"),
    "int2": ("int2", "row"),
    "ternary": ("ternary", "row"),
}
METRICS = ("plain", "whitened", "muon", "muon-mom", "adam")
# with an AdamW reference's optimizer state: the error of AdamW's next update (`adamw_update`) after
# one round trip, and after a 2-rank reduce-scatter of the batch's two halves (`-rs2`, each rank
# quantizing its own half; the form FSDP2 runs), next to the plain L2 error of the latter
ADAM_METRICS = ("adamw", "adamw-rs2", "plain-rs2")
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8  # `bench.lib.reference.make_optimizers`' AdamW
# weight of the current gradient in torch Muon's Nesterov update (momentum 0.95): 1 - 0.95^2
NESTEROV_WEIGHT = 1.0 - 0.95 ** 2


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--reference", choices=("adamw", "muon"), default="adamw",
                   help="optimizer the reference model was trained with (each is cached)")
    p.add_argument("--formats", default="e4m3/row,nvfp4,int4,int2", help=f"subset of {','.join(SWEEP_FORMATS)}")
    p.add_argument("--transforms", default=",".join(CANDIDATES),
                   help=f"subset of {','.join(CANDIDATES)} and (AdamW reference only) {','.join(ADAM_CANDIDATES)}")
    p.add_argument("--batches", type=int, default=8, help="held-out batches measured (>= 2: momentum proxy)")
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity" / "fidelity_sweep.json")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--profile", choices=("smoke", "quick"), default="quick",
                   help="reference model and batch size (smoke: the tiny CI model)")
    a = p.parse_args(argv)
    formats = [f for f in a.formats.split(",") if f]
    labels = [t for t in a.transforms.split(",") if t]
    unknown = sorted(set(formats) - set(SWEEP_FORMATS)) + sorted(set(labels) - set(CANDIDATES) - set(ADAM_CANDIDATES))
    if unknown:
        p.error(f"unknown format(s)/transform(s) {unknown}")
    if a.reference != "adamw" and set(labels) & set(ADAM_CANDIDATES):
        p.error(f"{sorted(set(labels) & set(ADAM_CANDIDATES))} need AdamW's state: --reference adamw")
    if "euclidean" not in labels:
        labels.insert(0, "euclidean")  # every gain is relative to it
    torch.set_num_threads(1)
    start = time.perf_counter()
    base = profile(a.profile)
    ref_settings = dataclasses.replace(base.reference, optimizer=a.reference)
    adam = a.reference == "adamw"
    fs = dataclasses.replace(base.fidelity, heldout_batches=a.batches, multirank_batches=0, keep_halves=adam)
    paths = corpus.prepare()
    model, record = reference.reference_model(ref_settings, paths, print, a.cache_dir)
    state = reference.optimizer_state(ref_settings, paths, a.cache_dir) if adam else None
    samples = reference.collect_samples(model, fs, paths, print)
    res = evaluate(samples, formats, labels, fs.damping, print, state)
    by_kind = {f: {t: res["by_kind"]["muon-mom"][f][t] for t in labels} for f in formats}
    out = {
        "command": "python -m bench.fidelity.sweep " + " ".join(argv if argv is not None else sys.argv[1:]),
        "reference": {"optimizer": a.reference, "val_bpb": record["val_bpb"],
                      "cache": str(reference.cache_path(ref_settings, paths, a.cache_dir))},
        "batches": a.batches, "layers": len({x.name for x in samples}), "formats": formats,
        "transforms": {t: list(CANDIDATES[t]) if t in CANDIDATES else ADAM_CANDIDATES[t] for t in labels},
        "nesterov_weight": NESTEROV_WEIGHT, "extra_bits": res["extra_bits"],
        "errors": res["errors"], "by_kind": res["by_kind"], "seconds": time.perf_counter() - start,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    err = res["errors"]
    for f in formats:
        print(f"\n{f} (reference trained with {a.reference}; {out['layers']} layers x {a.batches} batches): "
              "relative error (gain over Euclidean)")
        print(f"  {'transform':18s}" + "".join(f"{m:>19s}" for m in err) + "   muon-mom gain per kind")
        for t in labels:
            cells = "".join(f"{err[m][f][t]:9.4f} ({err[m][f]['euclidean'] / err[m][f][t]:5.2f}x)" for m in err)
            kind = " ".join(f"{k}:{v:.2f}" for k, v in by_kind[f][t].items())
            print(f"  {t:18s}{cells}   {kind}")
    print(f"\nwrote {a.out} ({out['seconds']:.0f} s)")
    return out


def _maps(label: str, sample: LayerSample, momentum: torch.Tensor, damping: float) -> tuple[Transform, Transform | None]:
    """Candidate `label` for `sample`: its column map (`bench.fidelity.round_trip.build_transform`, or for
    the `mom*` candidates the whitening of the momentum's factor M^T M / out) and, for the
    two-sided `mom2*` candidates, its row map from M M^T / in (else None). The momentum is the
    proxy, or for `-cur` the proxy updated with this gradient at Nesterov weight (an oracle)."""
    kind, rank, source = CANDIDATES[label]
    src, _, damp = source.partition("@")
    if not src.startswith("mom"):
        return fidelity.build_transform(kind, rank, source, sample, damping), None
    damping = float(damp) if damp else damping
    m = (1 - NESTEROV_WEIGHT) * momentum + NESTEROV_WEIGHT * sample.grad.double() if src.endswith("-cur") else momentum
    right = Transform(kind, sample.shape[1], rank or 32, seed=0)
    right.refresh_from(gradient_factor(m), damping)
    if not src.startswith("mom2"):
        return right, None
    left = Transform("dense", sample.shape[0], seed=0)
    left.refresh_from(gradient_factor(m.t()), damping)
    return right, left


class AdamCodec:
    """One `ADAM_CANDIDATES` prototype for one layer sample: built once from the layer's AdamW
    state (`exp_avg` m, `exp_avg_sq` v) and K-FAC source, then `round_trip` per format and rank.

    Order of the parts of a composed label: the side channel is split off first, the residual
    is scaled by vhat^(-p/2), then mapped by the K-FAC transform or a Hadamard, quantized by the
    product's Euclidean codec (`gift_compile.exchange.collectives.all_reduce`, no peers) and mapped
    back in reverse. `extra_bits` is the side channel's cost per gradient element.
    """

    def __init__(self, label: str, sample: LayerSample, st: dict[str, torch.Tensor], damping: float) -> None:
        rows, cols = sample.shape
        v, m = st["exp_avg_sq"].double(), st["exp_avg"].double()
        tiny = float(v[v > 0].min()) if bool((v > 0).any()) else 1e-30
        self.scale: torch.Tensor | None = None
        self.basis: torch.Tensor | None = None
        self.maps: list[Transform] = [Transform("identity", cols)] * 2
        self.extra_bits = 0.0
        for part in label.split("+"):
            if part.startswith(("vfac-p", "vfull-p", "vcol-p")):
                power = float(part.split("-p")[1])
                r, c = v.sum(dim=1), v.sum(dim=0)
                vhat = {"vfac": torch.outer(r, c) / r.sum(), "vfull": v,
                        "vcol": c.expand(rows, cols)}[part.split("-p")[0]]
                self.scale = vhat.clamp(min=tiny).pow(-power / 2)
                self.scale /= self.scale.pow(2).mean().sqrt()  # unit RMS: only the shape matters
            elif part == "kfac-r32":
                self.maps = [fidelity.build_transform("lowrank", 32, "kfac", sample, damping)] * 2
            elif part.startswith("side-r"):
                rank = int(part.removeprefix("side-r"))
                self.basis = torch.linalg.svd(m, full_matrices=False).Vh[:rank].t().contiguous()  # [cols, r]
                self.extra_bits = 16.0 * rank / cols
            elif part == "hadamard-rank":
                self.maps = [Transform("hadamard", cols, seed=1 + k) for k in range(2)]
            else:
                raise ValueError(f"unknown part {part!r} of AdamW candidate {label!r}")

    def round_trip(self, x: torch.Tensor, rank: int, config: GiftConfig) -> torch.Tensor:
        """What the receivers decode of `x` sent by `rank` (0 or 1)."""
        x = x.double()
        side = torch.zeros_like(x)
        if self.basis is not None:
            side = (x @ self.basis).to(torch.bfloat16).double() @ self.basis.t()
            x = x - side
        if self.scale is not None:
            x = x * self.scale
        y = all_reduce(x.float(), None, config, self.maps[rank]).double()
        if self.scale is not None:
            y = y / self.scale
        return y + side


def adamw_update(g: torch.Tensor, st: dict[str, torch.Tensor], clip: float) -> torch.Tensor:
    """AdamW's next update direction m_hat / (sqrt(v_hat) + eps) (weight decay aside: it does
    not see the gradient) from the saved state and the gradient `g`, clipped as training would."""
    (b1, b2), t = ADAM_BETAS, float(st["step"]) + 1
    g = g.double() * clip
    m = b1 * st["exp_avg"].double() + (1 - b1) * g
    v = b2 * st["exp_avg_sq"].double() + (1 - b2) * g * g
    return (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + ADAM_EPS)


def evaluate(samples: list[LayerSample], formats: list[str], labels: list[str], damping: float,
             log: Callable[[str], None], state: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, dict]:
    """Every metric for every (format, candidate): energy-weighted relative errors, and the
    geometric-mean gain over Euclidean per layer kind. With `state` (an AdamW reference's
    optimizer state) also `ADAM_METRICS` and the `ADAM_CANDIDATES`."""
    by_layer: dict[str, list[LayerSample]] = defaultdict(list)
    for x in samples:
        by_layer[x.name].append(x)
    if min(len(v) for v in by_layer.values()) < 2:
        raise ValueError("the momentum proxy needs at least 2 held-out batches (--batches)")
    if state is None and set(labels) & set(ADAM_CANDIDATES):
        raise ValueError(f"{sorted(set(labels) & set(ADAM_CANDIDATES))} need an AdamW reference's optimizer state")
    metrics = METRICS + (ADAM_METRICS if state is not None else ())
    num = {m: defaultdict(float) for m in metrics}  # (format, label, layer) -> sum ||error||^2
    den = {m: defaultdict(float) for m in metrics}  # layer -> sum ||reference||^2
    configs = {f: GiftConfig(format=SWEEP_FORMATS[f][0], scaling=SWEEP_FORMATS[f][1], geometry="lowrank", select="all")
               for f in formats}
    extra_bits: dict[str, float] = defaultdict(float)
    elements = sum(x.grad.numel() for x in samples)
    done = 0
    for name, group in by_layer.items():
        grads = torch.stack([x.grad.double() for x in group])
        inv_sqrt_v = grads.pow(2).mean(dim=0).add(1e-30).rsqrt()
        st = state[name] if state is not None else None
        for b, sample in enumerate(group):
            g = sample.grad
            momentum = (grads.sum(dim=0) - grads[b]) / (len(group) - 1)  # the other batches: the past
            update = NESTEROV_WEIGHT * g.double() + (1 - NESTEROV_WEIGHT) * momentum
            o, o_mom = fidelity.muon_direction(g), fidelity.muon_direction(update)
            basis = fidelity._EigenBasis(sample.a_cur, 1, damping)
            refs = {"plain": g.double(), "adam": g.double() * inv_sqrt_v}
            den["plain"][name] += float(refs["plain"].pow(2).sum())
            den["whitened"][name] += float((basis.energies(g) * basis.inv).sum())
            den["muon"][name] += float(o.pow(2).sum())
            den["muon-mom"][name] += float(o_mom.pow(2).sum())
            den["adam"][name] += float(refs["adam"].pow(2).sum())
            if st is not None:
                if sample.halves is None:
                    raise ValueError("the 2-rank AdamW metrics need the half-batch gradients (keep_halves)")
                g2 = sample.halves.double().mean(dim=0)
                u, u2 = adamw_update(g, st, sample.clip), adamw_update(g2, st, sample.clip)
                den["adamw"][name] += float(u.pow(2).sum())
                den["adamw-rs2"][name] += float(u2.pow(2).sum())
                den["plain-rs2"][name] += float(g2.pow(2).sum())
            for label in labels:
                if label in ADAM_CANDIDATES:
                    codec = AdamCodec(label, sample, st, damping)
                    extra_bits[label] += codec.extra_bits * g.numel() / elements

                    def trip(x: torch.Tensor, rank: int, config: GiftConfig) -> torch.Tensor:
                        return codec.round_trip(x, rank, config)
                else:
                    right, left = _maps(label, sample, momentum, damping)

                    def trip(x: torch.Tensor, rank: int, config: GiftConfig) -> torch.Tensor:
                        if left is None:
                            return all_reduce(x, None, config, right)
                        return fidelity.two_sided_round_trip(x, left, right, lambda y: all_reduce(y, None, config))
                for f, config in configs.items():
                    e = (trip(g, 0, config) - g).double()
                    key = (f, label, name)
                    num["plain"][key] += float(e.pow(2).sum())
                    num["whitened"][key] += float((basis.energies(e) * basis.inv).sum())
                    num["muon"][key] += float((fidelity.muon_direction(g + e) - o).pow(2).sum())
                    num["muon-mom"][key] += float(
                        (fidelity.muon_direction(update + NESTEROV_WEIGHT * e) - o_mom).pow(2).sum())
                    num["adam"][key] += float((e * inv_sqrt_v).pow(2).sum())
                    if st is not None:
                        num["adamw"][key] += float((adamw_update(g.double() + e, st, sample.clip) - u).pow(2).sum())
                        # FSDP2's reduce-scatter: each rank quantizes its own half, the owner sums in fp32
                        e2 = 0.5 * (trip(sample.halves[0], 0, config).double() + trip(sample.halves[1], 1, config).double()) - g2
                        num["adamw-rs2"][key] += float((adamw_update(g2 + e2, st, sample.clip) - u2).pow(2).sum())
                        num["plain-rs2"][key] += float(e2.pow(2).sum())
            done += 1
        log(f"  sweep: {done}/{len(samples)} layer samples")
    layers = list(by_layer)
    errors = {m: {f: {t: math.sqrt(sum(num[m][(f, t, n)] for n in layers) / sum(den[m][n] for n in layers))
                      for t in labels} for f in formats} for m in metrics}
    kinds = list(dict.fromkeys(n.split(".")[-2] for n in layers))
    by_kind = {m: {f: {t: {k: math.exp(statistics.fmean(
        0.5 * math.log(num[m][(f, "euclidean", n)] / num[m][(f, t, n)]) for n in layers if n.split(".")[-2] == k))
        for k in kinds} for t in labels} for f in formats} for m in metrics}
    return {"errors": errors, "by_kind": by_kind, "extra_bits": {t: extra_bits.get(t, 0.0) for t in labels}}


if __name__ == "__main__":
    main()
