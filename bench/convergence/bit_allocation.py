"""Bits allocated per layer at equal total bytes, from measured sensitivity (the frontier's
"per-layer bits" technique; `GiftConfig.layer_formats`).

Measures, on the convergence study's model and data, which layers a low-bit format hurts most,
and gives those layers more bits and the others fewer so that the wire bytes of the managed
layers stay at or under those of one format on every layer:

1. fp32 training of the study's model (one process on the study's global batch, Muon as the
   study's muon arms: the same recipe, `bench.lib.reference.train_step`) for `--steps` steps from
   a seed the study's runs do not use (`--seed`, default 100: the allocation is not fitted on
   the runs that judge it); the gradient of every managed weight is captured at each step after
   the warm-up.
2. Per layer and candidate format: the mean over those steps of the squared relative error of
   the format's round trip (`gift_compile.runtime.selection.round_trip`, plain coordinates, the
   codec a step sends with); per layer and format, the exact wire bytes (`FormatSpec.bits_per_element`
   of the layer's shape).
3. The allocation minimising the sum over layers of the squared relative error under the byte
   budget: each layer takes the format minimising `err^2 + lam * bytes`, `lam` the smallest
   value (bisection) that keeps the total within the budget. Relative, not absolute, error:
   Muon normalises each layer's update, so a layer's error matters in proportion to its own
   gradient, whatever its norm.

Writes `bench/results/convergence/bit_allocation.json` (per layer: errors, bytes, the chosen format; the
totals; the `layer_formats` entries the `-alloc` convergence arms read). Then the arms:

    python -m bench.convergence.bit_allocation && bash bench/convergence/frontier_techniques_runs.sh
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench.convergence.arms import ALLOCATION as OUT
from bench.convergence.arms import ALLOCATION_COMMAND as COMMAND
from bench.convergence.arms import FORMATS, format_spec
from bench.lib.reference import make_optimizers, train_step
from bench.lib.settings import profile
from bench.lib.tiny_llama import TinyLlama
from gift_compile.config import GiftConfig
from gift_compile.frameworks.routing import eligible_linears
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.selection import round_trip
from gift_compile.torchtitan_ext.cpu import corpus, language_modeling


def allocate(errors: dict[str, dict[str, float]], nbytes: dict[str, dict[str, float]],
             budget: float) -> dict[str, str]:
    """Per layer the candidate format minimising `err + lam * bytes` (`err` a squared relative
    error), for the smallest `lam >= 0` whose total bytes fit `budget`. Raises if even the
    cheapest format on every layer does not fit."""
    def pick(lam: float) -> dict[str, str]:
        return {n: min(errors[n], key=lambda f: (errors[n][f] + lam * nbytes[n][f], nbytes[n][f])) for n in errors}

    def total(choice: dict[str, str]) -> float:
        return sum(nbytes[n][f] for n, f in choice.items())

    cheapest = {n: min(nbytes[n], key=nbytes[n].get) for n in nbytes}
    if total(cheapest) > budget:
        raise ValueError(f"bit_allocation: the cheapest format on every layer takes {total(cheapest):.0f} bytes, "
                         f"over the budget of {budget:.0f}")
    if total(pick(0.0)) <= budget:
        return pick(0.0)
    lo, hi = 0.0, 1.0
    while total(pick(hi)) > budget:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if total(pick(mid)) > budget else (lo, mid)
    return pick(hi)


def measure(base: str, candidates: tuple[str, ...], steps: int, seed: int, world: int) -> dict[str, object]:
    """Capture the gradients of an fp32 Muon run and allocate (see the module docstring)."""
    s = profile("full").convergence
    torch.manual_seed(seed)
    model = TinyLlama(s.model, seed=seed)
    config = GiftConfig(**FORMATS[base])
    names = {fqn: m for fqn, m in eligible_linears(model, config, world, split_rows=True)}
    optimizers, peaks = make_optimizers(model, "muon", s.lr, s.muon_lr)
    params = list(model.parameters())
    paths = corpus.prepare()
    data = language_modeling.batches(corpus.token_stream("train", paths), s.local_batch * s.world, s.seq_len,
                                     seed=seed, rank=0, world_size=1, steps=steps)
    sq: dict[str, dict[str, float]] = {n: dict.fromkeys(candidates, 0.0) for n in names}
    captured = 0
    start = time.perf_counter()
    for step, (x, y) in enumerate(data):
        def capture() -> None:
            nonlocal captured
            if step < s.warmup:
                return
            captured += 1
            for n, m in names.items():
                g = m.weight.grad.detach().float()
                for f in candidates:
                    err = (round_trip(g, format_spec(f), IDENTITY_KIND, ()) - g).norm() / g.norm().clamp(min=1e-30)
                    sq[n][f] += float(err) ** 2
        train_step(model, params, optimizers, peaks, step, s.steps, s.warmup, x, y, capture)
    if captured == 0:
        raise ValueError(f"bit_allocation: --steps {steps} ends before the warm-up ({s.warmup} steps): no gradient "
                         "was captured")
    errors = {n: {f: v / captured for f, v in per.items()} for n, per in sq.items()}
    nbytes = {n: {f: format_spec(f).bits_per_element(m.weight.shape[1], m.weight.shape[0]) * m.weight.numel() / 8.0
                  for f in candidates} for n, m in names.items()}
    budget = sum(format_spec(base).bits_per_element(m.weight.shape[1], m.weight.shape[0]) * m.weight.numel() / 8.0
                 for m in names.values())
    choice = allocate(errors, nbytes, budget)
    elements = sum(m.weight.numel() for m in names.values())
    spent = sum(nbytes[n][f] for n, f in choice.items())
    return {
        "command": COMMAND, "base": base, "candidates": list(candidates), "seed": seed, "steps": steps,
        "captured_steps": captured, "seconds": time.perf_counter() - start,
        "budget_bits_per_element": 8.0 * budget / elements, "bits_per_element": 8.0 * spent / elements,
        "sum_sq_rel_error": {"uniform": sum(errors[n][base] for n in names),
                             "allocated": sum(errors[n][f] for n, f in choice.items())},
        "counts": {f: sum(c == f for c in choice.values()) for f in candidates},
        "layers": {n: {"shape": list(names[n].weight.shape), "sq_rel_error": errors[n], "bytes": nbytes[n],
                       "format": choice[n]} for n in names},
        # exact FQNs as globs: `GiftConfig.layer_formats`, the `-alloc` arms; layers at `base` need no entry
        "layer_formats": [f"{n}={f}" for n, f in choice.items() if f != base],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--format", default="int2", choices=sorted(FORMATS), help="the budget: this format on every layer")
    p.add_argument("--candidates", default="ternary,int2,int3", help="formats a layer may take (comma-separated)")
    p.add_argument("--steps", type=int, default=40, help="fp32 training steps; gradients captured after the warm-up")
    p.add_argument("--seed", type=int, default=100, help="model and data seed (not one the study's runs use)")
    p.add_argument("--world", type=int, default=2, help="the study's ranks (which weights split over them)")
    a = p.parse_args(argv)
    candidates = tuple(c.strip() for c in a.candidates.split(","))
    unknown = [c for c in (*candidates, a.format) if c not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; choose from {sorted(FORMATS)}")
    result = measure(a.format, candidates, a.steps, a.seed, a.world)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results[a.format] = result
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{a.format}: {result['counts']} at {result['bits_per_element']:.3f} bits per element "
          f"(budget {result['budget_bits_per_element']:.3f}); sum of squared relative errors "
          f"{result['sum_sq_rel_error']['uniform']:.3f} -> {result['sum_sq_rel_error']['allocated']:.3f}")
    if not math.isfinite(result["sum_sq_rel_error"]["allocated"]):
        raise SystemExit("bit_allocation: a non-finite error was measured")


if __name__ == "__main__":
    main()
