"""`python -m bench.fidelity.map_precision`: what TF32 or bf16 matmuls in the low-rank map do to the codec's error.

`GiftConfig.map_precision` runs the low-rank map's projection `P = G U` and expansion
`(P C) U^T` on CUDA as tensor-core kernels (`gift_compile.kernels.map_dispatch`): fp32
accumulation over operands rounded to TF32 (10 explicit mantissa bits) or bf16 (7). This bench
measures, on the CPU, what that rounding does where it matters, to the gradient the exchange
delivers:

- The tensor-core map is emulated in torch (`bench.fidelity.map_emulation.emulated_map`, the one
  emulation the convergence arms `-tf32` / `-bf16` run too): every matmul operand rounded to
  nearest even at the precision's mantissa width (`round_mantissa`), the products summed in
  fp32 (a torch fp32 matmul), the diagonal terms in fp32 as the kernels' epilogue computes them.
  "exact" is the map as the CPU runs it (`LowRank.apply_forward` / `apply_inverse`).
- On the bench's reference gradients (`bench.lib.reference`: the cached reference model of
  `--profile`, its held-out batches, every managed linear), each layer's map is the rank-32
  K-FAC whitening refreshed from the previous batch's factor (`bench.fidelity.round_trip.build_transform`,
  as the fidelity section builds `kfac-r32`). Each gradient goes forward map -> quantize ->
  dequantize (the reference codec) -> inverse map, with both maps at one precision; the error
  is `||decoded - G|| / ||G||`.
- Per format (nvfp4, int4, int2), the paired difference tf32 - exact and bf16 - exact of that
  error over the (layer, batch) samples, mean with its t-based 95% CI (`bench.lib.stats.paired`);
  and the map's own error against fp64 (forward image, and the round trip without a codec).

What the emulation leaves out: the order in which a tensor-core MMA sums its products (fp32
accumulation either way; the emulation's order is torch's), and TF32's rounding mode (Triton
converts with round-to-nearest, ties away from zero, where the emulation rounds ties to even:
they differ on exact ties only). Not measured here: the convergence arms (a training run per
precision: `bench.convergence.map_precision_arms`, the block after this one) and the kernels' own speed (a GPU's: `bench.gpu.check`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.fidelity import round_trip as fidelity
from bench.lib import reference
from bench.lib.formatting import paired_ci
from bench.fidelity.map_emulation import MANTISSA_BITS, emulated_map
from bench.lib.settings import profile
from bench.lib.stats import holm, paired
from gift_compile.codec import dequantize, quantize
from gift_compile.geometry.maps import LowRank
from gift_compile.kernels.map_dispatch import CUDA_DEFAULT
from bench.lib.paths import RESULTS

OUT = RESULTS / "fidelity" / "map_precision.json"
PRECISIONS = ("exact", *MANTISSA_BITS)
# (label, format, block size): GiftConfig's block_size default (32) for the integer formats
FORMATS = (("nvfp4", "nvfp4", 16), ("int4", "int4", 32), ("int2", "int2", 32))
RANK = 32

Log = Callable[[str], None]


def maps(tensors: tuple[torch.Tensor, ...], precision: str) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                      Callable[[torch.Tensor], torch.Tensor]]:
    """The forward and inverse low-rank map of `tensors` (`LowRank`'s) at `precision`."""
    if precision == "exact":
        return (lambda g: LowRank.apply_forward(g, tensors)), (lambda g: LowRank.apply_inverse(g, tensors))
    bits = MANTISSA_BITS[precision]
    dinv, v, cf, ci, dsq = tensors
    u = v * dinv.unsqueeze(1)
    return (lambda g: emulated_map(g, u, cf, dinv, dsq, bits)), (lambda g: emulated_map(g, v, ci, dsq, dsq, bits))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def sample_errors(g: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> dict[str, dict[str, float]]:
    """One gradient's errors per precision: the codec round trip's per format, and the map's own
    (`map_forward`: the forward image against fp64; `map_round_trip`: inverse of forward, no codec)."""
    t64 = tuple(t.double() for t in tensors)
    image64 = LowRank.apply_forward(g.double(), t64)
    out: dict[str, dict[str, float]] = {}
    for precision in PRECISIONS:
        fwd, inv = maps(tensors, precision)
        image = fwd(g)
        row = {"map_forward": _rel(image, image64), "map_round_trip": _rel(inv(image), g.double())}
        for label, fmt, block in FORMATS:
            row[label] = _rel(inv(dequantize(quantize(image, fmt, block_size=block))), g.double())
        out[precision] = row
    return out


def measure(samples: list[reference.LayerSample], damping: float, log: Log) -> dict[str, object]:
    """Every sample's errors and their paired statistics against "exact"."""
    per_sample = []
    for i, s in enumerate(samples):
        t = fidelity.build_transform("lowrank", RANK, "kfac", s, damping)
        per_sample.append({"layer": s.name, "batch": s.batch, "shape": list(s.shape),
                           "errors": sample_errors(s.grad, t.tensors)})
        if (i + 1) % 10 == 0:
            log(f"  {i + 1}/{len(samples)} samples")
    metrics = ("map_forward", "map_round_trip", *(f for f, _, _ in FORMATS))
    summary: dict[str, dict[str, object]] = {}
    for m in metrics:
        exact = [x["errors"]["exact"][m] for x in per_sample]
        summary[m] = {"exact_mean": sum(exact) / len(exact)}
        for precision in MANTISSA_BITS:
            vals = [x["errors"][precision][m] for x in per_sample]
            summary[m][precision] = {"mean": sum(vals) / len(vals),
                                     "minus_exact": paired([a - b for a, b in zip(vals, exact)]).as_dict()}
    return {"summary": summary, "samples": per_sample}


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.map_precision", description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("smoke", "quick", "full"), default="quick")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT, help="the results JSON (the docs block reads the default)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = profile(args.profile)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)

    samples = reference.reference_samples(settings.reference, settings.fidelity, args.cache_dir, log)
    result: dict[str, object] = {
        "command": "python -m bench.fidelity.map_precision" + (f" --profile {args.profile}" if args.profile != "quick" else ""),
        "profile": args.profile, "rank": RANK, "damping": settings.fidelity.damping,
        "layers": len({s.name for s in samples}), "batches": len({s.batch for s in samples}),
        "widths": sorted({s.shape[1] for s in samples}), "mantissa_bits": MANTISSA_BITS,
        "formats": [list(f) for f in FORMATS],
        **measure(samples, settings.fidelity.damping, log),
    }
    result["seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(block(path=args.out))
    return result


def _sci(x: float) -> str:
    return f"{x:.2e}"


def block(_: dict | None = None, path: Path = OUT) -> str:
    """The docs/benchmarks.md block: per metric, the exact map's error and the paired change
    TF32 and bf16 make to it, with the conclusions computed from `bench/results/fidelity/map_precision.json`."""
    d = json.loads(path.read_text())
    s = d["summary"]
    formats = [f for f, _, _ in d["formats"]]
    lines = [f"Low-rank map at TF32 / bf16 operands (emulated on the CPU: operands rounded to nearest even at "
             f"{d['mantissa_bits']['tf32']} / {d['mantissa_bits']['bf16']} mantissa bits, fp32 sums; "
             f"`{d['command']}` -> [bench/results/fidelity/map_precision.json](../bench/results/fidelity/map_precision.json)): "
             f"{d['layers']} layers x {d['batches']} held-out batches of the reference model (widths "
             f"{', '.join(map(str, d['widths']))}), each layer's rank-{d['rank']} K-FAC map refreshed from the previous "
             "batch; relative error of the decoded gradient through forward map -> quantize -> dequantize -> inverse "
             "map, and of the map alone against fp64. Differences are paired over the samples, mean ± 95% CI (n).",
             "", "| metric | exact | TF32 − exact | bf16 − exact |", "|---|---|---|---|"]
    # the table is one family of comparisons (every metric x precision): a difference counts as
    # resolved where Holm's step-down rejects it at a family-wise 5%, not where its own CI excludes 0
    family = [(m, p) for m in s for p in ("tf32", "bf16")]
    held = dict(zip(family, holm([s[m][p]["minus_exact"]["p"] for m, p in family])))
    for m, v in s.items():
        lines.append(f"| {m} | {_sci(v['exact_mean'])} | "
                     + " | ".join(paired_ci(v[p]["minus_exact"], digits=7) + (" *" if held[m, p] else "")
                                  for p in ("tf32", "bf16"))
                     + " |")
    worst = {p: max((abs(s[f][p]["minus_exact"]["mean"]) + s[f][p]["minus_exact"]["ci95"]) / s[f]["exact_mean"]
                    for f in formats) for p in ("tf32", "bf16")}
    resolved = {p: [f for f in formats if held[f, p]] for p in ("tf32", "bf16")}
    ratio = s["map_forward"]["bf16"]["mean"] / s["map_forward"]["tf32"]["mean"]
    notes = []
    for p, name in (("tf32", "TF32"), ("bf16", "bf16")):
        where = (f"resolved at {', '.join(resolved[p])}" if resolved[p] else "resolved at no format")
        notes.append(f"{name} changes the codec's error by at most {worst[p]:.2%} of it (the far end of the 95% CI, "
                     f"worst format; {where})")
    rt = s["map_round_trip"]
    finer = min(("tf32", "bf16"), key=lambda p: worst[p])
    lines += ["", f"`*`: resolved, Holm's step-down over the table's {len(family)} comparisons at a family-wise 5% "
                  f"(the CIs shown are each comparison's own). {'; '.join(notes)}. The map's own error is "
                  f"{_sci(s['map_forward']['tf32']['mean'])} at TF32 and {_sci(s['map_forward']['bf16']['mean'])} at bf16 "
                  f"({ratio:.1f}x), against {_sci(s['map_forward']['exact_mean'])} for the exact map and "
                  f"{_sci(min(s[f]['exact_mean'] for f in formats))} for the finest format's codec; through the inverse "
                  f"map, whose gain on the factor's strong directions the whitening's conditioning sets, the round trip "
                  f"without a codec errs by {_sci(rt['tf32']['mean'])} at TF32 and {_sci(rt['bf16']['mean'])} at bf16. "
                  f"`map_precision=\"auto\"` runs {CUDA_DEFAULT.value} on CUDA; of the two, "
                  f"{'TF32' if finer == 'tf32' else 'bf16'} moves the codec's error least here. What the same rounding "
                  "does to training (the convergence arms at TF32 / bf16, paired per seed with the exact map): the "
                  "next block (`bench.convergence.map_precision_arms`)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
