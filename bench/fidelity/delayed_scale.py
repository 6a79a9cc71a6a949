"""`python -m bench.fidelity.delayed_scale`: would a delayed tensor scale cost the two-level formats fidelity?

The two-level formats (every format of the table with a tensor scale: nvfp4, int6, int4, int3,
int2, ternary) map the largest block statistic of the whole tensor onto E4M3's range before the
first block code can be written, so the sender reads the (mapped) gradient twice: once for the
statistics, once to encode. FP8 training recipes avoid the first read with a *delayed* scale,
the amax of earlier steps, and count the saturations it causes. Whether that is free here
depends on how much a gradient's largest block statistic moves from step to step, which only
real gradients can say, so this bench measures it before any such option exists.

Gradients: one training run of the bench's small Llama with the reference model's recipe
(`bench.lib.reference.train_step`: AdamW, warm-up then cosine, clipping; the quick profile's model,
batch and learning rate) from initialisation. At every step, in the collective's place (after
backward, before clipping, as GIFT sends it), every managed linear's gradient is taken twice:
as it is (`euclidean`) and after GIFT's rank-32 low-rank K-FAC map (`gift`), refreshed on the
product's schedule (`GiftConfig.refresh_due`: steps 10, 20, 40, 50, ...) from an EMA
(`GiftConfig.ema`) of the layer's exact input factor, so the mapped gradient's amax also jumps
at refreshes, as it would in the product.

Arms, per layer, domain and format, each quantizing the same tensor (round to nearest, block 32
for the integer formats, nvfp4's own 16):

- `two-pass`: today's codec, the current tensor's largest block statistic (the scales are
  checked bit for bit against `gift_compile.codec.choose_scales` on every tensor);
- `previous`: the previous step's largest statistic of that layer, domain and format;
- `history16`: the largest over the last 16 steps (FP8 recipes' amax history);
- `history16x2`: that times 2 (one binade of margin).

A delayed arm has no statistic on the first step of a run (or after a refresh changes the map,
if its history were reset): a real implementation would run the two-pass form there. The
delayed arms are measured only on steps whose history is full (after the first 16 steps of
tracking), so the first step's fallback is not part of their numbers.

Error: relative L2 error of the round trip, `||Q(x) - x|| / ||x||`, of the tensor the codec
quantizes (the mapped gradient in `gift`), decoded by the codec's own `encode` / `decode` with
the arm's scales. Saturation: a block whose E4M3 scale code clips at 448 because the arm's
tensor scale is too small (two-pass never does); clipped elements: elements of saturated blocks
beyond the top grid level times the decoded block scale (what the small scale cut off; int2 and
ternary clip outliers by design in every arm, which is not counted).

Statistics, fixed before the run: per (domain, format, delayed arm), the paired quantity is the
relative error increase `err_arm / err_two_pass - 1`, averaged over the measured steps of each
layer: one value per managed layer (layers as the unit, because consecutive steps of one layer
are correlated and would make a per-(layer, step) interval too narrow). Its mean gets a
t-based confidence interval, Bonferroni-corrected over the whole family (domains x formats x
delayed arms) to 95% family-wise.

Decision rule, stated before the numbers: a delayed tensor scale "costs nothing in fidelity"
only if some delayed arm, in both domains and for every format, has the upper end of its
corrected interval below `THRESHOLD` (0.5% relative error increase) AND at most
`SATURATION_LIMIT` (one in a million) of its blocks saturated. Otherwise the exact two-pass
form stays the only one. `verdict` computes this for one window; the docs block requires it in
every window of `RUNS` (`free_arms`) and prints the decision.

Windows: `bench/results/fidelity/delayed_scale.json`, steps 49-96 of a 96-step run (the default
command), and `bench/results/fidelity/delayed_scale_late.json`, steps 153-200 of a 200-step run
(`--steps 200 --measure 48 --out bench/results/fidelity/delayed_scale_late.json`). The rule was first
applied to the early window alone, where the 16-step history with margin 2 passed; the late
window was run as a check before its numbers were seen, and reading both can only make the
rule harder to pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from bench.lib import reference
from bench.lib.formatting import table
from bench.lib.provenance import commit
from bench.lib.settings import profile
from bench.lib.stats import t_quantile
from bench.lib.tiny_llama import TinyLlama
from gift_compile.codec import FormatSpec, as_rows, choose_scales, decode, encode
from gift_compile.codec.codes import grid_codes
from gift_compile.codec.formats import FORMAT_TABLE
from gift_compile.codec.layout import _blocks
from gift_compile.codec.scales import E4M3_MAX, _e4m3_code, _e4m3_decode, _finite_amax, _mean_abs, _pow2_inverse, _tensor_scale
from gift_compile.codec.spec import _pad_cols
from gift_compile.config import GiftConfig
from gift_compile.geometry import Transform
from gift_compile.torchtitan_ext.cpu import corpus, language_modeling
from bench.lib.paths import RESULTS

OUT = RESULTS / "fidelity" / "delayed_scale.json"
# the measured windows the decision reads: the default command's, and a later one of a longer run
RUNS = (OUT, OUT.with_name("delayed_scale_late.json"))
HISTORY = 16
MARGIN = 2.0
# arm -> (history length it reads, factor on the statistic it reads)
DELAYED: dict[str, tuple[int, float]] = {"previous": (1, 1.0), f"history{HISTORY}": (HISTORY, 1.0),
                                         f"history{HISTORY}x{MARGIN:g}": (HISTORY, MARGIN)}
DOMAINS = ("euclidean", "gift")
THRESHOLD = 0.005
SATURATION_LIMIT = 1e-6
FAMILY_ALPHA = 0.05


def two_level_specs(block_size: int = 32) -> tuple[FormatSpec, ...]:
    """Every format of the table with a tensor scale (read off the table, not listed by name)."""
    return tuple(FormatSpec(name, "row", block_size) for name, fam in FORMAT_TABLE.items() if fam.has_tensor_scale)


def _row_view(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return _pad_cols(as_rows(x).float(), spec)


def block_statistic(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Each block's scale statistic `[rows, nblocks]`, as `TwoLevel.choose_scales` computes it."""
    xb = _blocks(_row_view(x, spec), spec.block)
    step = spec.family.mean_abs_step
    return _finite_amax(xb, -1, keepdim=False) if step is None else _mean_abs(xb, step, as_rows(x).shape[-1])


@functools.cache
def top_level(spec: FormatSpec) -> float:
    """The largest magnitude the format's grid decodes to, in units of the block scale (what a
    value far past the scale rounds to)."""
    one = torch.ones(1, 1)
    return float(spec.family.grid.values(grid_codes(torch.full((1, 1), 1e30), one, one, spec.family.grid, None)).abs())


@dataclasses.dataclass(frozen=True)
class Coded:
    """One round trip with a given largest statistic: its error and what its scale cut off."""

    error: float  # ||Q(x) - x|| / ||x||
    blocks: int
    saturated_blocks: int  # E4M3 scale codes clipped at 448
    clipped_elements: int  # elements of saturated blocks past the top level of the decoded scale
    tensor_scale: float


def scales_with_max(x: torch.Tensor, spec: FormatSpec, gmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(scales, tensor_scale, saturated)` of `x` when the tensor's largest block statistic is
    taken to be `gmax` (`[1]`) instead of the current one: `TwoLevel.choose_scales` with the
    global maximum replaced, step for step, so that `gmax` = the current maximum gives the
    codec's scales bit for bit (the test checks it). `saturated` marks blocks whose unit
    exceeds E4M3's largest value, where the code clips."""
    fam = spec.family
    stat = block_statistic(x, spec)
    gscale = _tensor_scale(gmax, fam.level)
    unit = stat * _pow2_inverse(gscale)
    if fam.level != 1.0:
        unit = unit * (1.0 / fam.level)
    return _e4m3_code(unit), gscale, unit > E4M3_MAX


def code_with_max(x: torch.Tensor, spec: FormatSpec, gmax: torch.Tensor) -> Coded:
    """Round trip of `x` through the codec's `encode` / `decode` with the scales `scales_with_max`
    gives for `gmax`, and the saturation it caused."""
    scales, gscale, saturated = scales_with_max(x, spec, gmax)
    cols = as_rows(x).shape[-1]
    xhat = decode(encode(x, spec, scales, gscale), spec, scales, gscale, cols).reshape(x.shape)
    bound = _e4m3_decode(scales) * gscale * top_level(spec)
    over = _blocks(_row_view(x, spec).abs(), spec.block) > bound.unsqueeze(-1)
    clipped = int((over & saturated.unsqueeze(-1)).sum())
    err = float((xhat - x).norm() / x.norm()) if bool(x.any()) else 0.0
    return Coded(err, saturated.numel(), int(saturated.sum()), clipped, float(gscale))


def current_max(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """The tensor's largest block statistic (`[1]`): what the two-pass form's first read finds."""
    return block_statistic(x, spec).amax().reshape(1)


def two_pass(x: torch.Tensor, spec: FormatSpec) -> Coded:
    """Today's codec: the current maximum, with the scales checked against the codec's own
    `choose_scales` (a bench whose reference arm drifted from the product would raise here)."""
    gmax = current_max(x, spec)
    scales, gscale, _ = scales_with_max(x, spec, gmax)
    ref_scales, ref_gscale = choose_scales(x, spec)
    if not (torch.equal(scales, ref_scales) and torch.equal(gscale, ref_gscale)):
        raise AssertionError(f"{spec.name}: the bench's scales differ from gift_compile.codec.choose_scales")
    return code_with_max(x, spec, gmax)


def delayed_max(history: deque[torch.Tensor], length: int, factor: float) -> torch.Tensor:
    """The largest statistic of the last `length` steps times `factor` (`[1]`)."""
    recent = list(history)[-length:]
    return torch.stack(recent).amax(0) * factor


class Tally:
    """Per (domain, format, arm): per-layer relative error increases over two-pass, saturation
    per step, and the share of layer-steps whose tensor scale differs from two-pass."""

    def __init__(self) -> None:
        self.increase: dict[tuple[str, str, str], dict[str, list[float]]] = {}
        self.errors: dict[tuple[str, str, str], list[float]] = {}
        self.blocks: dict[tuple[str, str, str], int] = {}
        self.saturated_by_step: dict[tuple[str, str, str], dict[int, int]] = {}
        self.clipped: dict[tuple[str, str, str], int] = {}
        self.scale_moves: dict[tuple[str, str, str], list[int]] = {}  # log2(arm / two-pass tensor scale)

    def add(self, key: tuple[str, str, str], layer: str, step: int, arm: Coded, ref: Coded) -> None:
        inc = arm.error / ref.error - 1.0 if ref.error > 0 else 0.0
        self.increase.setdefault(key, {}).setdefault(layer, []).append(inc)
        self.errors.setdefault(key, []).append(arm.error)
        self.blocks[key] = self.blocks.get(key, 0) + arm.blocks
        by_step = self.saturated_by_step.setdefault(key, {})
        by_step[step] = by_step.get(step, 0) + arm.saturated_blocks
        self.clipped[key] = self.clipped.get(key, 0) + arm.clipped_elements
        self.scale_moves.setdefault(key, []).append(round(math.log2(arm.tensor_scale / ref.tensor_scale)))


def corrected_ci(values: list[float], family: int, alpha: float = FAMILY_ALPHA) -> tuple[float, float, float]:
    """`(mean, lower, upper)` of `values` with a two-sided t interval at level `1 - alpha /
    family` (Bonferroni: the family's intervals all hold with probability >= 1 - alpha)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(1.0 - alpha / (2 * family), n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def summarize(tally: Tally) -> dict[str, dict[str, dict[str, object]]]:
    """domain -> format -> arm -> the numbers the decision reads (and the docs print)."""
    family = sum(1 for k in tally.increase if k[2] in DELAYED)
    out: dict[str, dict[str, dict[str, object]]] = {}
    for key in sorted(tally.increase):
        domain, fmt, arm = key
        per_layer = [statistics.fmean(v) for v in tally.increase[key].values()]
        sat = tally.saturated_by_step[key]
        moves = tally.scale_moves[key]
        row: dict[str, object] = {
            "mean_rel_error": statistics.fmean(tally.errors[key]),
            "layers": len(per_layer), "layer_steps": len(moves), "blocks": tally.blocks[key],
            "saturated_blocks": sum(sat.values()), "saturation_rate": sum(sat.values()) / tally.blocks[key],
            "steps_with_saturation": sum(1 for v in sat.values() if v), "steps": len(sat),
            "saturated_blocks_by_step": {str(s): v for s, v in sorted(sat.items())},
            "clipped_elements": tally.clipped[key],
            "scale_lower": sum(m < 0 for m in moves) / len(moves), "scale_higher": sum(m > 0 for m in moves) / len(moves),
        }
        if arm in DELAYED:
            mean, lo, hi = corrected_ci(per_layer, family)
            row.update({"increase_mean": mean, "increase_lo": lo, "increase_hi": hi, "family": family})
        out.setdefault(domain, {}).setdefault(fmt, {})[arm] = row
    return out


def verdict(summary: dict[str, dict[str, dict[str, object]]]) -> dict[str, object]:
    """The decision rule of the module docstring, applied: per delayed arm, whether it stays under
    the threshold and the saturation limit in every domain and format; free if any arm does."""
    arms: dict[str, dict[str, object]] = {}
    for arm in DELAYED:
        failing = []
        for domain, fmts in summary.items():
            for fmt, by_arm in fmts.items():
                r = by_arm[arm]
                if not (r["increase_hi"] < THRESHOLD and r["saturation_rate"] <= SATURATION_LIMIT):
                    failing.append(f"{domain}/{fmt}")
        arms[arm] = {"free": not failing, "failing": failing}
    free = [a for a, v in arms.items() if v["free"]]
    return {"free": bool(free), "free_arms": free, "arms": arms, "threshold": THRESHOLD,
            "saturation_limit": SATURATION_LIMIT}


class KfacMaps:
    """GIFT's low-rank K-FAC maps of the managed linears, fed and refreshed as the product does:
    an EMA of each layer's input factor, a refresh at `GiftConfig.refresh_due` steps."""

    def __init__(self, linears: dict[str, torch.nn.Linear], config: GiftConfig) -> None:
        self.config = config
        self.maps = {n: Transform("lowrank", m.in_features, config.rank) for n, m in linears.items()}
        self.ema: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            a = x.t() @ x / x.shape[0]
            old = self.ema.get(name)
            self.ema[name] = a if old is None else self.config.ema * old + (1.0 - self.config.ema) * a
        return hook

    def after_step(self, step: int) -> None:
        """End of optimizer step `step` (1-based): refresh every map when the schedule says so."""
        if self.config.refresh_due(step):
            for name, t in self.maps.items():
                t.refresh_from(self.ema[name].float(), self.config.damping)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run(steps: int, measure: int, log: Callable[[str], None] = print) -> tuple[Tally, dict[str, object]]:
    """Train, and at each of the last `measure` steps quantize every managed gradient in every arm."""
    if measure > steps - HISTORY:
        raise ValueError(f"--measure {measure} needs --steps >= {measure + HISTORY} (a full {HISTORY}-step history)")
    s = dataclasses.replace(profile("quick").reference, steps=steps)
    paths = corpus.prepare()
    model = TinyLlama(s.model, seed=s.seed)
    config = GiftConfig(geometry="lowrank")
    linears = reference.managed_linears(model, config)
    maps = KfacMaps(linears, config)
    specs = two_level_specs(config.block_size)
    history: dict[tuple[str, str, str], deque[torch.Tensor]] = {}
    tally = Tally()
    optimizers, peaks = reference.make_optimizers(model, s.optimizer, s.lr, s.muon_lr)
    params = list(model.parameters())
    tokens = corpus.token_stream("train", paths)
    first = steps - measure + 1
    losses: list[float] = []
    start = time.perf_counter()

    def observe(step: int) -> None:
        with torch.no_grad():
            for name, mod in linears.items():
                g = mod.weight.grad.detach().float()
                for domain, x in (("euclidean", g), ("gift", maps.maps[name].forward(g))):
                    for spec in specs:
                        hist = history.setdefault((name, domain, spec.name), deque(maxlen=HISTORY))
                        if step >= first:
                            ref = two_pass(x, spec)
                            tally.add((domain, spec.name, "two-pass"), name, step, ref, ref)
                            for arm, (length, factor) in DELAYED.items():
                                tally.add((domain, spec.name, arm), name, step,
                                          code_with_max(x, spec, delayed_max(hist, length, factor)), ref)
                        hist.append(current_max(x, spec))

    batches = language_modeling.batches(tokens, s.batch_size, s.seq_len, seed=s.seed, steps=steps)
    try:
        for i, (x, y) in enumerate(batches):
            step = i + 1
            value = reference.train_step(model, params, optimizers, peaks, i, steps, s.warmup, x, y,
                                         sync=lambda: observe(step))
            maps.after_step(step)
            losses.append(float(value))
            if step % 8 == 0 or step == steps:
                log(f"  step {step}/{steps} loss {value.item():.3f} ({time.perf_counter() - start:.0f} s)")
    finally:
        maps.close()
    setup = {"model": dataclasses.asdict(s.model), "steps": steps, "measured_steps": [first, steps],
             "batch_size": s.batch_size, "seq_len": s.seq_len, "lr": s.lr, "warmup": s.warmup,
             "optimizer": s.optimizer, "layers": len(linears), "rank": config.rank, "ema": config.ema,
             "damping": config.damping, "refresh_steps": [k for k in range(1, steps + 1) if config.refresh_due(k)],
             "formats": {sp.name: {"block": sp.block, "statistic": "amax" if sp.family.mean_abs_step is None
                                   else f"{sp.family.mean_abs_step:g} x mean|x|"} for sp in specs},
             "losses": losses, "seconds": time.perf_counter() - start}
    return tally, setup


def free_arms(verdicts: list[dict[str, object]]) -> list[str]:
    """The delayed arms that pass the rule in every measured window (each window's `verdict`)."""
    return [a for a in DELAYED if all(v["arms"][a]["free"] for v in verdicts)]


def _cells(r: dict[str, object]) -> list[str]:
    return [f"{100 * r['increase_mean']:+.3f}% ({100 * r['increase_hi']:+.3f}%)",
            f"{r['saturated_blocks']} ({r['saturation_rate']:.1e}; {r['steps_with_saturation']}/{r['steps']})"]


def block(_: dict) -> str:
    """The docs block (docs/design.md): every window's arms against two-pass, and the decision,
    computed from the windows' result files (`RUNS`)."""
    runs = [json.loads(path.read_text()) for path in RUNS]
    for path, d in zip(RUNS, runs):
        if d["verdict"] != verdict(d["summary"]):
            raise ValueError(f"{path.name}: its verdict is not what its summary gives; rerun {d['command']}")
    first = runs[0]
    label = [f"steps {d['setup']['measured_steps'][0]}-{d['setup']['measured_steps'][1]}" for d in runs]
    rows = []
    for domain, fmts in first["summary"].items():
        for fmt in fmts:
            for arm in DELAYED:
                rows.append([domain, fmt, arm, *[c for d in runs for c in _cells(d["summary"][domain][fmt][arm])]])
    family = next(iter(next(iter(first["summary"].values())).values()))["previous"]["family"]
    free = free_arms([d["verdict"] for d in runs])
    th, lim = first["verdict"]["threshold"], first["verdict"]["saturation_limit"]
    cells = sum(len(fmts) for d in runs for fmts in d["summary"].values())
    if free:
        decision = (f"**Decision: a delayed tensor scale costs nothing measurable here** ({', '.join(free)}: upper end "
                    f"below {100 * th:g}% and at most {lim:g} of blocks saturated in every window, domain and format). "
                    "GIFT does not offer it yet: the codec runs the two-pass form only.")
    else:
        why = []
        for arm in DELAYED:
            rs = [by[arm] for d in runs for fmts in d["summary"].values() for by in fmts.values()]
            above = sum(r["increase_hi"] >= th for r in rs)
            saturating = sum(r["saturation_rate"] > lim for r in rs)
            passed = [lab for lab, d in zip(label, runs) if d["verdict"]["arms"][arm]["free"]]
            why.append(f"{arm}: upper end at or above {100 * th:g}% in {above} of {cells} window-domain-format cells, "
                       f"saturation above {lim:g} in {saturating} of {cells}"
                       + (f", passing in {' and '.join(passed)} only" if passed else ""))
        decision = ("**Decision: the exact two-pass form is kept, and no delayed tensor scale is offered**: no delayed "
                    "arm passes the rule in every window, domain and format (" + "; ".join(why) + "). A gradient whose "
                    "largest block statistic jumps past the history's maximum times the margin saturates blocks "
                    "the two-pass form encodes exactly.")
    sources = "; ".join(
        f"{lab} of {d['setup']['steps']}: `{d['command']}`, {d['date']}, commit {d['commit']}, refreshes at steps "
        f"{', '.join(map(str, d['setup']['refresh_steps']))}" for lab, d in zip(label, runs))
    two = "; ".join(f"{dom} " + ", ".join(f"{f} " + " / ".join(f"{d['summary'][dom][f]['two-pass']['mean_rel_error']:.4f}"
                                                               for d in runs) for f in fmts)
                    for dom, fmts in first["summary"].items())
    return "\n".join([
        f"Delayed tensor scale against the exact two-pass one, {first['setup']['layers']} managed layers of the "
        "bench's small Llama trained from initialisation with the reference recipe (AdamW), gradients taken where the "
        f"collective runs, as they are (euclidean) and after GIFT's rank-{first['setup']['rank']} K-FAC map (gift), in "
        f"{len(runs)} windows ({sources}; {first['machine']}). Per window: relative error increase over two-pass, mean "
        "over layers of each layer's mean over the window's steps, and in brackets the upper end of its 95% interval "
        f"Bonferroni-corrected over the window's {family} comparisons; saturated blocks (E4M3 scale code clipped at "
        "448), their rate and the steps with any. Two-pass relative error (" + " / ".join(label) + f"): {two}.",
        "",
        table(["domain", "format", "arm", *[f"{lab}: {c}" for lab in label for c in ("error increase (upper end)",
                                                                                   "saturated blocks (rate; steps)")]],
              rows),
        "",
        decision + " A delayed arm also has no statistic on a run's first step, where it would need the two-pass "
        "form anyway.",
    ])


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.delayed_scale", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=96, help="training steps in all")
    p.add_argument("--measure", type=int, default=48, help="the last steps measured (needs 16 tracked before)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load = os.getloadavg()[0]
    tally, setup = run(a.steps, a.measure)
    summary = summarize(tally)
    result = {"command": "python -m bench.fidelity.delayed_scale" + "".join(f" {x}" for x in (argv or sys.argv[1:])),
              "date": datetime.date.today().isoformat(), "commit": commit(),
              "machine": f"{os.cpu_count()} CPU cores shared with other jobs (load {load:.1f} at start), "
                         f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
              "setup": setup, "summary": summary, "verdict": verdict(summary)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["verdict"], indent=1))
    return result


if __name__ == "__main__":
    main()
