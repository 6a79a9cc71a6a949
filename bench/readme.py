"""README.md's measured-number blocks, rendered from `bench/results/results.json`.

A number typed into the README by hand goes stale when its section is re-run (the step-time
bullet said -9.1% for GIFT fp8 on 13 fc2 layers, from the step model of 13:06, after the
re-run of 14:50 that prices deselected layers as the code runs them gave -10.2%). So the
blocks between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` are generated:
`python -m bench.readme` rewrites them, `--check` exits non-zero when they differ from what
results.json gives (a test runs the check on the committed files).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

from bench.fidelity_sweep import ORACLES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results" / "results.json"
HSDP_MODEL = ROOT / "bench" / "results" / "hsdp_step_model.json"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _ci(p: dict) -> str:
    if p["n"] < 2:
        return f"{p['mean']:+.4f} (n=1)"
    return f"{p['mean']:+.4f} ± {p['ci95']:.4f} (n={p['n']})"


def _share(g: dict) -> str:
    share = g["share_closed"]
    if share != share:
        return "no resolved Euclidean gap to close"
    ci = g["share_closed_ci95"]
    return f"{100 * share:.0f}% closed ({'CI unbounded' if ci is None else f'{100 * ci[0]:.0f}% to {100 * ci[1]:.0f}%'})"


def step_model(r: dict) -> str:
    """The step-time projection bullet (calibrated scenario, and with TF32 matmuls)."""
    sm = r["step_model"]
    cal, tf32 = sm["scenarios"]["calibrated"], sm["scenarios"]["calibrated, TF32 matmuls"]
    a = {k: v["vs_fp32"] for k, v in cal["arms"].items()}
    t = {k: v["vs_fp32"] for k, v in tf32["arms"].items()}
    return (f"* **Step-time projection** ({cal['model']}, {cal['inputs']['gpus']} GPUs; codec bytes from the generated "
            "kernels, statistics FLOPs counted, hardware figures assumed, the exposed-communication fraction "
            f"calibrated so Euclidean FP8 reproduces the paper's {_pct(sm['paper']['euclid-fp8'])}): GIFT fp8 on 13 fc2 "
            f"layers {_pct(a['gift-fp8 (13 fc2)'])} (paper {_pct(sm['paper']['gift-fp8 (13 fc2)'])}; as the code runs "
            "it, the deselected layers take the Euclidean codec without statistics), GIFT fp8 on all layers "
            f"{_pct(a['gift-fp8 (all layers)'])}, GIFT NVFP4 on all layers {_pct(a['gift-nvfp4 (all layers)'])}, "
            f"Euclidean NVFP4 {_pct(a['euclid-nvfp4'])}; with TF32 matmuls for the codec "
            f"{_pct(t['gift-fp8 (13 fc2)'])} / {_pct(t['gift-fp8 (all layers)'])} (13 fc2 / all layers). "
            f"Step model run: `{r['meta']['sections']['step_model']['command']}`.")


def convergence(r: dict) -> str:
    """The convergence bullet: per path and optimizer, each bit width's gaps and share closed,
    and where GIFT is resolved better or worse than Euclidean (all computed from the summary)."""
    cv = r["convergence"]
    classes = "; ".join(f"`{o}` = {' + '.join(v['classes'])}" for o, v in cv["optimizer_classes"].items())
    lines = [f"* **Convergence** ({cv['world']} gloo ranks, the bench's small Llama, {cv['steps']} steps of "
             f"{cv['tokens_per_step']:,} tokens; every arm of a seed shares init and data order; held-out bits/byte "
             "minus fp32 communication of the same seed and path, mean ± t-based 95% CI over n seeds; share closed "
             f"with Fieller's 95% CI; report section 5). Optimizers as run: {classes}."]
    for path, pv in cv["paths"].items():
        for opt, o in pv["optimizers"].items():
            parts = []
            for key, g in o["gaps"].items():
                parts.append(f"{key} ({g['bits']:.2f} bits): Euclidean {_ci(g['euclid_minus_fp32'])}, GIFT "
                             f"{_ci(g['gift_minus_fp32'])}, {_share(g)}")
            better = [k for k, g in o["gaps"].items() if g["gift_minus_euclid"]["resolved"] and g["gift_minus_euclid"]["mean"] < 0]
            worse = [k for k, g in o["gaps"].items() if g["gift_minus_euclid"]["resolved"] and g["gift_minus_euclid"]["mean"] > 0]
            v = o["verdict"]
            first = v.get("first_costly")
            lines.append(
                f"  **{path}, {opt}**: " + ("; ".join(parts) if parts else "no Euclidean/GIFT pair yet")
                + ". Euclidean first costs loss (Holm over the tested bit widths, 5% family-wise) at "
                + (f"**{first}**" if first else "no tested width")
                + f"; GIFT resolved better than Euclidean at: {', '.join(better) or 'none'}; worse at: "
                + f"{', '.join(worse) or 'none'}.")
    return "\n".join(lines)


def adamw_sweep(r: dict) -> str:
    """The AdamW geometry candidates of the fidelity sweeps that carry the AdamW metrics: each
    candidate's gain over Euclidean in AdamW's update (one round trip / 2-rank reduce-scatter)
    and in plain L2, its extra bits, and the best candidate that costs no extra bits."""
    sweeps = [sw for sw in r.get("sweeps", []) if "adamw" in sw["errors"]]
    if not sweeps:
        return "* **AdamW geometry sweep**: not run (no sweep with the AdamW metrics attached)."
    lines = ["* **AdamW geometry sweep** (report 2.5; AdamW-trained reference with its saved optimizer state; gain "
             "over Euclidean = Euclidean error / candidate error in AdamW's next update after one round trip / after a "
             "2-rank reduce-scatter, and in plain L2; extra bits per element where a side channel costs them):"]
    for sw in sweeps:
        err, extra = sw["errors"], sw.get("extra_bits", {})
        for f in sw["formats"]:
            def gain(m: str, t: str) -> float:
                return err[m][f]["euclidean"] / err[m][f][t]
            cells = [f"{t} {gain('adamw', t):.2f}x/{gain('adamw-rs2', t):.2f}x (plain {gain('plain', t):.2f}x"
                     + (f", +{extra[t]:.2f} bits" if extra.get(t, 0) > 0 else "") + ")"
                     for t in sw["transforms"] if t != "euclidean"]
            free = [t for t in sw["transforms"] if t != "euclidean" and extra.get(t, 0) == 0 and t not in ORACLES]
            best = max(free, key=lambda t: gain("adamw-rs2", t)) if free else None
            lines.append(f"  `{sw['file']}` {f}: " + "; ".join(cells)
                         + (f". Best runnable candidate at no extra bits (reduce-scatter; oracles "
                            f"{', '.join(sorted(ORACLES & set(sw['transforms']))) or 'none'} left out): **{best}** "
                            f"{gain('adamw-rs2', best):.2f}x." if best else "."))
    return "\n".join(lines)


def codec(r: dict) -> str:
    """The codec bullet: per op and format, the Euclidean and GIFT low-rank bodies' generated
    bytes next to their minimum (and the run before the codec work, when attached)."""
    c = r["codec"]
    st = c["settings"]
    parts = []
    for op in st["ops"]:
        for fmt, _ in st["formats"]:
            cells = []
            for x in c["rows"]:
                if (x["op"], x["format"]) == (op, fmt) and x["kind"] in ("identity", "lowrank"):
                    was = (f", was {x['before_bytes_per_element']:.1f} in {x['before_kernels']}"
                           if x.get("before_bytes_per_element") is not None else "")
                    cells.append(f"{'Euclidean' if x['kind'] == 'identity' else 'GIFT'} {x['bytes_per_element']:.1f} B "
                                 f"in {x['kernels']} kernels ({x['vs_minimum']:.2f}x its minimum "
                                 f"{x['minimum']:.1f}{was})")
            parts.append(f"{op} {fmt}: " + ", ".join(cells))
    within = sum(x["vs_minimum"] <= 1.3 for x in c["rows"])
    return (f"* **Codec cost** ({st['shape'][0]}, rank {st['rank']}, {st['world']}-rank plans; bytes per gradient "
            "element read off Inductor's generated kernels, next to the minimum the work needs, computed from "
            "shapes and formats by `bench.codec_minimum.minimum_bytes`; report section 3b): " + "; ".join(parts)
            + f". Within 1.3x of the minimum: {within} of {len(c['rows'])} paths (all maps and formats). "
            f"Codec run: `{r['meta']['sections']['codec']['command']}`.")


def hsdp_model(_: dict) -> str:
    """The HSDP step-model bullet, from `bench.hsdp_model`'s own results file (it prices codec
    bytes from results.json, so it is re-run after the codec section and read here)."""
    d = json.loads(HSDP_MODEL.read_text())
    per_model = []
    for model, arms in d["models"].items():
        best = min((a for a in arms if a.startswith("HSDP")), key=lambda a: arms[a]["step_s"])
        cells = ", ".join(f"{a} {_pct(v['vs_fsdp_fp32'])}" for a, v in arms.items() if a != "FSDP fp32")
        per_model.append(f"{model}: {cells} (best HSDP arm: **{best}**, {arms[best]['network_bytes'] / 1e9:.2f} GB "
                         f"of network traffic per GPU)")
    return ("* **HSDP, a precision per hop** (`python -m bench.hsdp_model` -> "
            "[bench/results/hsdp_step_model.md](bench/results/hsdp_step_model.md); "
            f"{d['sources']['nodes, gpus_per_node'].split(': ')[-1]}, NVLink inside a node and a 400 Gb/s NIC per GPU "
            "assumed, codec bytes measured from the generated kernels, the exposed share calibrated on the "
            "paper's Euclidean FP8 figure and applied to both hops; step time against flat FSDP at fp32): "
            + "; ".join(per_model) + ".")


BLOCKS: dict[str, Callable[[dict], str]] = {"step_model": step_model, "codec": codec, "convergence": convergence,
                                            "adamw_sweep": adamw_sweep, "hsdp_model": hsdp_model}


def render(readme: str, results: dict) -> str:
    """`readme` with every generated block replaced by what `results` gives; raises when a
    block's markers are missing (a block is never silently skipped)."""
    for name, fn in BLOCKS.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n)(?:.*?\n)?(<!-- /bench:{name} -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"README has no block <!-- bench:{name} --> ... <!-- /bench:{name} -->")
        readme = pattern.sub(lambda m: m.group(1) + fn(results) + "\n" + m.group(2), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.readme", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--check", action="store_true", help="exit 1 if the README's blocks differ from the results")
    a = p.parse_args(argv)
    text = a.readme.read_text()
    new = render(text, json.loads(a.results.read_text()))
    if a.check:
        if new != text:
            print(f"{a.readme}: generated blocks differ from {a.results}; run python -m bench.readme", file=sys.stderr)
            return 1
        return 0
    a.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
