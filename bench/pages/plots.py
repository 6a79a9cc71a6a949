"""PNG figures of the benchmark results (matplotlib, Agg backend: no display needed).

Each function takes its section's JSON-ready result dict and writes one file into `out`,
returning the file name, so the report can link exactly the figures that were produced.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

# Formats the per-layer/eigen/multi-rank figures show: the paper's setting, the best fp8
# setting (per-row E4M3), and the 4-bit format.
FOCUS_FORMATS = ("e5m2/tensor", "e4m3/row", "nvfp4")


def _save(fig: plt.Figure, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def fidelity_heatmap(fid: dict, out: Path) -> str:
    """Energy-weighted relative error per format x transform; colour = gain over Euclidean."""
    formats, transforms = fid["formats"], fid["transforms"]
    err = np.array([[fid["energy_weighted"][f][t] for t in transforms] for f in formats])
    gain = err[:, :1] / err
    fig, ax = plt.subplots(figsize=(1.2 * len(transforms) + 2.5, 0.55 * len(formats) + 1.8))
    im = ax.imshow(np.log2(gain), cmap="RdBu", vmin=-1.5, vmax=1.5, aspect="auto")
    for i in range(len(formats)):
        for j in range(len(transforms)):
            ax.text(j, i, f"{err[i, j]:.4f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(transforms)), transforms, rotation=30, ha="right")
    ax.set_yticks(range(len(formats)), [f"{f}  (RD {fid['rd_bound'][f]:.4f})" for f in formats])
    fig.colorbar(im, ax=ax, label="log2(Euclidean error / error)")
    ax.set_title("One round trip: energy-weighted relative L2 error (blue = better than Euclidean)")
    return _save(fig, out, "fidelity_heatmap.png")


def fidelity_layers(fid: dict, out: Path) -> str:
    """Per-layer gain over Euclidean of K-FAC rank-32 and dense whitening, in both metrics."""
    layers = fid["layers"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5), sharey=True, sharex=True)
    x = np.arange(len(layers))
    for row, (metric, key) in enumerate((("plain L2", "per_layer"), ("whitened metric", "per_layer_whitened"))):
        for col, transform in enumerate(("kfac-r32", "kfac-dense")):
            ax = axes[row][col]
            for f in FOCUS_FORMATS:
                if f in fid[key]:
                    pl = fid[key][f]
                    ax.plot(x, [pl["euclidean"][n] / pl[transform][n] for n in layers], "o-", ms=4, lw=0.8, label=f)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{transform}: gain in the {metric} (Euclidean error / error)", fontsize=9)
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xticks(x, [n.removeprefix("layers.").removesuffix(".weight") for n in layers], rotation=90, fontsize=6)
    return _save(fig, out, "fidelity_layers.png")


def fidelity_eigen(fid: dict, out: Path) -> str:
    """Relative error along the eigendirections of A (strong to weak): flat = isotropic."""
    shown = [f for f in FOCUS_FORMATS if f in fid["eigen_buckets"]]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.6 * len(shown), 3.8), sharey=True, squeeze=False)
    for ax, f in zip(axes[0], shown):
        for t in ("euclidean", "hadamard", "kfac-dense", "kfac-r32", "grad-r32"):
            if t in fid["eigen_buckets"][f]:
                values = fid["eigen_buckets"][f][t]
                ax.plot(range(1, len(values) + 1), values, "o-", ms=4, label=t)
        ax.set_yscale("log")
        ax.set_xlabel("eigendirection bucket of A (1 = largest eigenvalues)")
        ax.set_title(f)
    axes[0][0].set_ylabel("relative L2 error in the bucket")
    axes[0][-1].legend(fontsize=8)
    return _save(fig, out, "fidelity_eigen.png")


def multirank(fid: dict, out: Path) -> str:
    """Error of the P-rank mean: our collective vs in-network FP8-code sums (one agreed scale, or
    each rank's local scale)."""
    mr = fid["multirank"]
    ranks = sorted(int(p) for p in mr)
    shown = [f for f in ("e5m2/tensor", "e4m3/row", "nvfp4") if f in mr[str(ranks[0])]]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.6 * len(shown), 3.8), sharey=True, squeeze=False)
    for ax, f in zip(axes[0], shown):
        for t, style in (("euclidean", "-"), ("kfac-r32", "--")):
            for what, color in (("ours_reduce_scatter", "tab:blue"), ("ours_all_reduce", "tab:green"),
                                ("agreed_in_network", "tab:purple"), ("original", "tab:red")):
                ys = [mr[str(p)][f][t].get(what, math.nan) for p in ranks]
                if not all(math.isnan(y) for y in ys):
                    ax.plot(ranks, ys, style, marker="o", color=color, label=f"{what} / {t}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks P")
        ax.set_title(f)
    axes[0][0].set_ylabel("relative L2 error of the mean")
    axes[0][0].legend(fontsize=7)
    return _save(fig, out, "multirank.png")


def overhead(ov: dict, out: Path) -> str:
    """Measured bytes per gradient element and median CPU time per path, grouped by shape."""
    rows = ov["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(2 * (2.2 * len(shapes) + 4), 4))
    width = 0.8 / len(paths)
    for k, path in enumerate(paths):
        xs = np.arange(len(shapes)) + k * width
        ax1.bar(xs, [next(r["bytes_per_element"] for r in rows if r["shape"] == s and r["path"] == path)
                     for s in shapes], width, label=path)
        ax2.bar(xs, [next(r["median_ms"] for r in rows if r["shape"] == s and r["path"] == path) for s in shapes],
                width, label=path)
    for ax in (ax1, ax2):
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes, fontsize=8)
        ax.legend(fontsize=8)
    ax1.set_ylabel("bytes per gradient element (generated kernels)")
    ax1.set_title("Memory traffic of the compiled codec (1 rank, all-reduce)")
    ax2.set_yscale("log")
    ax2.set_ylabel(f"median ms ({ov['mode']}, CPU, {ov['threads']} threads)")
    ax2.set_title("CPU time of the compiled codec")
    return _save(fig, out, "overhead.png")


def wire(wr: dict, out: Path, world: int = 64, op: str = "all_reduce") -> str:
    """Bytes per rank per step relative to fp32, per format and model."""
    rows = [r for r in wr["rows"] if r["world"] == world and r["op"] == op]
    models = list(dict.fromkeys(r["model"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(models)
    for k, m in enumerate(models):
        ys = [next(r["vs_fp32"] for r in rows if r["model"] == m and r["format"] == f) for f in formats]
        ax.bar(np.arange(len(formats)) + k * width, ys, width, label=m)
    ax.set_xticks(np.arange(len(formats)) + 0.4 - width / 2, formats)
    ax.set_ylabel("bytes per step / fp32")
    ax.set_title(f"Gradient bytes per rank per step ({op}, {world} ranks; unmanaged params at fp32)")
    ax.legend()
    return _save(fig, out, "wire.png")


def convergence(cv: dict, out: Path) -> str:
    """Per optimizer: each arm's final held-out bits/byte minus fp32 (paired, 95% CI)."""
    opts = list(cv["optimizers"])
    fig, axes = plt.subplots(1, len(opts), figsize=(7 * len(opts), 4.6), squeeze=False)
    for ax, opt in zip(axes[0], opts):
        arms = [a for a in cv["optimizers"][opt]["arms"] if a != "fp32"]
        diffs = [cv["optimizers"][opt]["arms"][a]["paired_diff_bpb"] for a in arms]
        y = np.arange(len(arms))
        ci = [0.0 if d["ci95"] != d["ci95"] else d["ci95"] for d in diffs]
        colors = ["tab:orange" if a.startswith("gift") else "tab:blue" for a in arms]
        ax.barh(y, [d["mean"] for d in diffs], xerr=ci, color=colors, alpha=0.8, capsize=3)
        ax.set_yticks(y, arms, fontsize=8)
        ax.axvline(0, color="black", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("held-out bits/byte minus fp32 (same seed), mean ± 95% CI")
        ax.set_title(f"{opt}: {cv['steps']} steps, {len(cv['seeds'])} seeds")
    fig.suptitle(f"{cv['world']}-rank gloo pretraining ({cv['mode']}); blue = Euclidean, orange = GIFT")
    return _save(fig, out, "convergence.png")


def step_model(sm: dict, out: Path) -> str:
    """Projected step-time breakdown and the change against fp32 communication."""
    scenarios = sm["scenarios"]
    arms = list(next(iter(scenarios.values()))["arms"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.6))
    shown = "calibrated" if "calibrated" in scenarios else "defaults"
    base = scenarios[shown]["arms"]
    bottom = np.zeros(len(arms))
    for part in ("compute_s", "exposed_comm_s", "codec_s", "stats_s", "refresh_s"):
        ys = np.array([base[a][part] for a in arms])
        ax1.bar(range(len(arms)), ys, bottom=bottom, label=part.removesuffix("_s"))
        bottom += ys
    ax1.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("seconds per step")
    first = next(iter(scenarios.values()))
    ax1.set_title(f"{first['model']}, {first['inputs']['gpus']} GPUs: {shown} (refresh sharded over ranks)", fontsize=9)
    ax1.legend(fontsize=8)
    width = 0.8 / len(scenarios)
    limit = 40.0
    for k, (name, sc) in enumerate(scenarios.items()):
        ys = [100 * sc["arms"][a]["vs_fp32"] for a in arms]
        xs = np.arange(len(arms)) + k * width
        ax2.bar(xs, np.clip(ys, -limit, limit), width, label=name)
        for x, y in zip(xs, ys):
            if abs(y) > limit:  # clipped bar: print its value
                ax2.text(x, np.sign(y) * limit, f"{y:+.0f}%", fontsize=6, ha="center", rotation=90,
                         va="top" if y > 0 else "bottom")
    for arm, value in sm["paper"].items():
        if arm in arms:
            i = arms.index(arm)
            ax2.plot([i - 0.1, i + 0.9], [100 * value] * 2, "k--", lw=1.2)
            ax2.text(i + 0.4, 100 * value, f"paper {100 * value:+.1f}%", fontsize=7, ha="center", va="bottom")
    ax2.axhline(0, color="gray", lw=0.8)
    ax2.set_xticks(np.arange(len(arms)) + 0.4 - width / 2, arms, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("step time vs fp32 communication (%)")
    ax2.set_ylim(-limit, limit)
    ax2.legend(fontsize=7)
    return _save(fig, out, "step_model.png")
