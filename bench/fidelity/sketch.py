"""`python -m bench.fidelity.sketch`: GIFT whitened from the sketch against the exact factor.

`gift_compile.geometry.statistics.SketchStatistics` keeps `A Omega` (d_in x 2r) and `diag A` instead of
the dense K-FAC factor. This measures what that costs in fidelity and what it saves:

1. On the bench's reference gradients (the cached reference model of `--profile`, held-out
   batches as in the fidelity section), the whitened-metric round-trip error of the rank-r
   transform built from the sketch (`kfac-sketch-r32`) and from the exact factor
   (`kfac-r32`), through `bench.fidelity.round_trip.round_trip_errors` itself: energy-weighted over
   layers and per layer, per format, and their ratios (`--ref-cols`: wider sketches too).
2. With `--scaling`, the same ratio at widths the reference model does not reach, on synthetic
   factors: a power-law spectrum `lambda_i = i^-alpha` (the reference's layers span
   alpha ~0.6-2.0 over their bulk) in a random basis, gradient rows `Z A^{1/2}`. A sketch's
   error grows with the trace outside the top of the spectrum, which can grow with width,
   so this checks whether the 2r-column default holds at LLM widths (on synthetic spectra,
   not on a real wide model's activations).
3. Persistent statistics bytes per layer (`KFACStatistics` on the meta device vs
   `SketchStatistics.nbytes`) and per rank for every managed linear of Llama-600M and
   Llama-3-8B, and the FLOPs of one `observe` and of one refresh at those widths.

Only the fidelity section's round trips run (no multi-rank simulation, no other transforms),
so it takes minutes once the reference model is cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from bench.fidelity import round_trip as fidelity
from bench.lib import reference
from bench.lib.settings import FORMATS, TRANSFORMS, profile
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import all_reduce
from gift_compile.geometry import Transform, lowrank_refresh_flops
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics

EXACT, SKETCH = "kfac-r32", "kfac-sketch-r32"
DEFAULT_FORMATS = ("e4m3/row", "e5m2/tensor", "nvfp4")
# (model, decoder blocks, input widths of one block's managed linears: q, k, v, o, gate, up, down)
MODELS = (("Llama-600M", 32, (1280,) * 6 + (3456,)), ("Llama-3-8B", 32, (4096,) * 6 + (14336,)))


def cost_table(rank: int, tokens: int, max_tokens: int) -> dict[str, object]:
    """Statistics memory and FLOPs, exact vs sketch, per layer width and per model."""
    widths = sorted({d for _, _, ds in MODELS for d in ds})
    per_width = {}
    for d in widths:
        dense = KFACStatistics(d, ema=0.95, max_tokens=max_tokens, device="meta")
        sketch = SketchStatistics(d, rank=rank, ema=0.95, max_tokens=max_tokens)
        m = -(-tokens // max(1, -(-tokens // max_tokens)))
        per_width[d] = {
            "exact_bytes": sum(t.numel() * t.element_size() for t in dense.state_dict().values()),
            "sketch_bytes": sketch.nbytes(),
            "sketch_cols": sketch.cols,
            "exact_observe_flops": 2.0 * m * d * d + d * d,  # sub^T sub, accumulate
            "sketch_observe_flops": sketch.observe_flops(tokens),
            "exact_refresh_flops": lowrank_refresh_flops(d, rank),
            "sketch_refresh_flops": sketch.whitening_flops(rank),
        }
    models = {}
    for name, blocks, ds in MODELS:
        models[name] = {k: blocks * sum(per_width[d][k] for d in ds)
                        for k in ("exact_bytes", "sketch_bytes", "exact_observe_flops", "sketch_observe_flops")}
    return {"rank": rank, "tokens_per_observe": tokens, "max_tokens": max_tokens,
            "per_width": per_width, "per_model": models}


@torch.no_grad()
def synthetic_ratio(d: int, alpha: float, cols: tuple[int, ...], formats: tuple[tuple[str, str, str], ...],
                    rank: int = 32, rows: int = 256, damping: float = 1e-3, seed: int = 0) -> dict[str, dict[int, float]]:
    """Whitened round-trip error ratio sketch / exact on one synthetic factor of width `d`.

    The metric is the fidelity section's (`_EigenBasis` of the same `A`, damped); the sketch
    observes `sqrt(d) A^{1/2}` (`fidelity.sketched`), so only the sketch differs.
    """
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    lam = torch.arange(1, d + 1, dtype=torch.float64) ** -alpha
    a = ((q * lam) @ q.t()).float()
    half = (q * lam.sqrt()) @ q.t()
    g = (torch.randn(rows, d, generator=gen, dtype=torch.float64) @ half).float()
    floor = damping * float(lam.mean())
    inv = 1.0 / (lam + floor)

    def werr(t: Transform, config: GiftConfig) -> float:
        e = all_reduce(g, None, config, t) - g
        return float((((e.double() @ q) ** 2).sum(0) * inv).sum())

    exact = Transform("lowrank", d, rank)
    exact.refresh_from(a, damping)
    out: dict[str, dict[int, float]] = {}
    for label, fmt, sc in formats:
        config = GiftConfig(format=fmt, scaling=sc, select="all")
        ref = werr(exact, config)
        out[label] = {}
        for k in cols:
            t = Transform("lowrank", d, rank)
            t.refresh_from_stats(fidelity.sketched(a, rank, k), damping)
            out[label][k] = math.sqrt(werr(t, config) / ref)
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.sketch", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("smoke", "quick", "full"), default="quick")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="labels from bench.lib.settings.FORMATS")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per observe in the FLOP table")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ref-cols", default="", help="also sketches of these widths k on the reference, e.g. 96,128")
    p.add_argument("--scaling", action="store_true", help="also the synthetic width sweep (minutes per width)")
    p.add_argument("--widths", default="512,1280,3456", help="synthetic widths for --scaling")
    p.add_argument("--alphas", default="0.65,1.0", help="power-law exponents for --scaling")
    p.add_argument("--cols", default="64,128", help="sketch widths k for --scaling")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = profile(args.profile)
    formats = tuple(f for f in FORMATS if f[0] in args.formats.split(","))
    ref_cols = tuple(int(c) for c in args.ref_cols.split(",")) if args.ref_cols else ()
    wider = tuple((f"kfac-sketch-k{k}-r32", "lowrank", 32, f"kfac-sketch:{k}") for k in ref_cols)
    transforms = tuple(t for t in TRANSFORMS if t[0] in (EXACT, SKETCH)) + wider
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)

    samples = reference.reference_samples(settings.reference, settings.fidelity, args.cache_dir, log)
    rt = fidelity.round_trip_errors(samples, formats, transforms, settings.fidelity, log)
    result: dict[str, object] = {
        "profile": args.profile, "layers": len({x.name for x in samples}), "batches": len({x.batch for x in samples}),
        "widths": sorted({x.shape[1] for x in samples}), "formats": {}, "seconds": None,
    }
    for f, *_ in formats:
        per_layer = rt["per_layer_whitened"][f]
        for label, *_ in transforms[1:]:
            ratios = {n: per_layer[label][n] / per_layer[EXACT][n] for n in per_layer[EXACT]}
            worst = max(ratios, key=lambda n: abs(ratios[n] - 1.0))
            result["formats"].setdefault(label, {})[f] = {
                "whitened_exact": rt["whitened"][f][EXACT], "whitened_sketch": rt["whitened"][f][label],
                "whitened_ratio": rt["whitened"][f][label] / rt["whitened"][f][EXACT],
                "euclidean_ratio": rt["energy_weighted"][f][label] / rt["energy_weighted"][f][EXACT],
                "worst_layer": worst, "worst_layer_ratio": ratios[worst],
                "layer_ratio_range": [min(ratios.values()), max(ratios.values())],
            }
    if args.scaling:
        cols = tuple(int(c) for c in args.cols.split(","))
        result["scaling"] = {}
        for d in (int(w) for w in args.widths.split(",")):
            for alpha in (float(x) for x in args.alphas.split(",")):
                result["scaling"][f"d={d} alpha={alpha}"] = synthetic_ratio(d, alpha, cols, formats)
                log(f"  synthetic d={d} alpha={alpha}: {result['scaling'][f'd={d} alpha={alpha}']}")
    # the default config's statistics subsample: what a real run observes per step and layer
    result["costs"] = cost_table(32, args.tokens, GiftConfig().stats_tokens)
    result["seconds"] = time.perf_counter() - start
    result["settings"] = dataclasses.asdict(settings.fidelity)
    _print(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def _print(r: dict) -> None:
    print(f"\nwhitened round-trip error, {r['layers']} layers x {r['batches']} held-out batches "
          f"(widths {r['widths']}), profile {r['profile']}")
    print(f"{'sketch':<22}{'format':<13}{'exact':>10}{'sketch':>10}{'ratio':>8}{'eucl ratio':>12}  worst layer (ratio)")
    for label, by_format in r["formats"].items():
        for f, v in by_format.items():
            print(f"{label:<22}{f:<13}{v['whitened_exact']:>10.5f}{v['whitened_sketch']:>10.5f}"
                  f"{v['whitened_ratio']:>8.4f}{v['euclidean_ratio']:>12.4f}  {v['worst_layer']} "
                  f"({v['worst_layer_ratio']:.4f})")
    if "scaling" in r:
        print("\nsynthetic power-law factors, whitened error ratio sketch / exact (rank 32), by sketch width k:")
        for case, by_format in r["scaling"].items():
            print(f"  {case:<22}" + "  ".join(f"{f} " + " ".join(f"k{k}={v:.4f}" for k, v in ks.items())
                                             for f, ks in by_format.items()))
    c = r["costs"]
    print(f"\nper layer (rank {c['rank']}, observe of {c['tokens_per_observe']} tokens, "
          f"subsample {c['max_tokens']}):")
    print(f"{'d_in':>6}{'k':>5}{'exact MB':>11}{'sketch MB':>11}{'x':>7}{'exact GF/obs':>14}{'sketch GF/obs':>15}"
          f"{'exact GF/refresh':>18}{'sketch GF/refresh':>19}")
    for d, v in c["per_width"].items():
        print(f"{d:>6}{v['sketch_cols']:>5}{v['exact_bytes'] / 2**20:>11.1f}{v['sketch_bytes'] / 2**20:>11.2f}"
              f"{v['exact_bytes'] / v['sketch_bytes']:>7.0f}{v['exact_observe_flops'] / 1e9:>14.3f}"
              f"{v['sketch_observe_flops'] / 1e9:>15.4f}{v['exact_refresh_flops'] / 1e9:>18.2f}"
              f"{v['sketch_refresh_flops'] / 1e9:>19.4f}")
    for name, v in c["per_model"].items():
        print(f"{name}: statistics per rank {v['exact_bytes'] / 2**30:.2f} GiB exact vs "
              f"{v['sketch_bytes'] / 2**30:.3f} GiB sketch; observe FLOPs per step "
              f"{v['exact_observe_flops'] / 1e12:.2f} TF vs {v['sketch_observe_flops'] / 1e12:.3f} TF")
    print(f"({r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
