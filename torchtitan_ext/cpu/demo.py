"""`make demo`: GIFT's recommended config in a real torchtitan run, next to plain low-bit and fp32.

One command that shows what GIFT does to training, without a GPU or a download: it trains
the small Llama on the embedded Shakespeare corpus on 2 ranks (gloo on CPU; torchtitan
picks NCCL on CUDA) three times with the same seed, init and data order: GIFT as recommended
(NVFP4 gradient reduce-scatters, geometry chosen from the optimizer with
``--gift.geometry auto`` as the shipped TOMLs set it, per-layer selection
``auto``), plain low-bit (the same codec and bytes, ``--gift.geometry none``: no map) and fp32
(GIFT off). It prints the losses of the three, the bytes each sent at the collectives,
which layers GIFT's map helps and by how much, and which low-bit arm ended closer to fp32.
It launches exactly the torchrun command a user would (:func:`.runs.run_config`) and streams
the per-step JSONL records the runs write, so the numbers are torchtitan's own, not
re-derived here.

    python -m gift_compile.torchtitan_ext.cpu.demo [--nproc 2] [--steps N] [--format F] [--no-compare]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from typing import Any

from gift_compile.config import FORMATS

from .runs import RunResult, run_config

# Two runs on 2 shared cores, cold Inductor cache: 270 s measured (GIFT on 195 s, of which
# 110 s to step 1; GIFT off 74 s); the plain low-bit arm adds about one GIFT run.
DEFAULT_STEPS = 100
# The format where GIFT's map helps: at nvfp4 the selection keeps about half the layers (their
# transformed error below the Euclidean one); at fp8_e4m3 it keeps none, so GIFT = plain fp8.
DEFAULT_FORMAT = "nvfp4"
REFRESH_EVERY = 10  # as in configs/*.toml
VALIDATE_EVERY = 20
GIFT_CONFIGS = ("llama3_debug_gift_graph", "llama3_debug_gift_fsdp2")
# As in configs/llama3_debug_gift*.toml: the geometry follows the optimizer (second_moment under
# the configs' AdamW, where the convergence study measured it ahead of plain low-bit and of K-FAC).
GEOMETRY = "auto"
# Arm label -> the name the summary prints.
ARM_NAMES = {"GIFT": "GIFT ({fmt})", "plain": "plain low-bit ({fmt})", "fp32": "fp32 (GIFT off)"}
# What `gift_compile.api.resolve_auto` logs for each automatic choice it made.
_RESOLVED = re.compile(r"\b(geometry|select_metric)='auto' -> '(\w+)'")


def _stream_run(label: str, config: str, overrides: list[str], nproc: int, timeout_s: float) -> RunResult:
    """run_config in a thread; print each JSONL record as the run appends it."""
    with tempfile.TemporaryDirectory(prefix="gift_demo_") as folder:
        jsonl = os.path.join(folder, "gift_metrics.jsonl")
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["result"] = run_config(config, overrides, dump_folder=folder, nproc=nproc, timeout_s=timeout_s)
            except Exception as exc:  # a timeout (subprocess.TimeoutExpired) or a launch error
                outcome["error"] = exc

        start = time.time()  # records carry time.time() of their writing
        print(f"\n[{label}] {config}, {nproc} ranks: launching (the first step includes compilation) ...", flush=True)
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        offset = 0
        while True:
            finished = not thread.is_alive()  # checked before reading, so no final record is missed
            if os.path.exists(jsonl):
                with open(jsonl, encoding="utf-8") as f:
                    f.seek(offset)
                    text = f.read()
                complete = text[: text.rfind("\n") + 1]  # a line still being written waits
                offset += len(complete.encode("utf-8"))
                for line in complete.splitlines():
                    if line.strip():
                        record = json.loads(line)
                        _print_record(label, record, record["time"] - start)
            if finished:
                break
            thread.join(1.0)
    if "error" in outcome:
        sys.exit(f"demo: the {label} run ({config}) did not finish: {outcome['error']}")
    result: RunResult = outcome["result"]
    if result.returncode != 0:
        sys.exit(f"{result.output[-6000:]}\ndemo: the {label} run ({config}) failed with exit code "
                 f"{result.returncode} (output tail above)\n  command: {' '.join(result.command)}")
    print(f"[{label}] done in {result.wall_s:.0f} s", flush=True)
    return result


def _print_record(label: str, record: dict[str, Any], elapsed: float) -> None:
    if "validation_loss" in record:
        text = f"validation loss {record['validation_loss']:.5f}"
    else:
        text = f"loss {record['loss']:.5f}"
        if "gift/refresh_step" in record:
            refresh, selected = record["gift/refresh_step"], record["gift/selected_layers"]
            text += f"   (GIFT refresh at step {refresh:.0f}: {selected:.0f} layers selected)"
    print(f"[{label}] {elapsed:6.1f} s  step {record['step']:4d}  {text}", flush=True)


def _validation(result: RunResult) -> dict[int, float]:
    return {r["step"]: r["validation_loss"] for r in result.records if "validation_loss" in r}


def _table(title: str, columns: dict[str, dict[int, float]]) -> None:
    """One row per step of the first arm, one column per arm (NaN where an arm lacks the step)."""
    labels = list(columns)
    print(f"\n{title}\n  {'step':>4}" + "".join(f"  {label:>10}" for label in labels))
    for step in sorted(columns[labels[0]]):
        print(f"  {step:4d}" + "".join(f"  {columns[label].get(step, math.nan):10.5f}" for label in labels))


def resolved_choices(output: str) -> dict[str, str]:
    """What ``auto`` resolved to in a run's log (`geometry`, `select_metric`);
    raises unless every rank logged the same choice for both."""
    found: dict[str, set[str]] = {"geometry": set(), "select_metric": set()}
    for key, value in _RESOLVED.findall(output):
        found[key].add(value)
    if any(len(values) != 1 for values in found.values()):
        raise RuntimeError(f"demo: the GIFT-on run did not log one resolved geometry and select_metric: {found}")
    return {key: values.pop() for key, values in found.items()}


def last_measured_refresh(result: RunResult) -> dict[str, Any] | None:
    """The record of the last refresh that measured per-layer errors.

    A refresh measures only the layers it may (re)select: once a decision left none selected,
    later refreshes until the next reselection measure none."""
    return next((r for r in reversed(result.records) if any(k.startswith("gift/selected/") for k in r)), None)


def selected_errors(refresh: dict[str, Any]) -> tuple[int, int, float, float]:
    """(selected, measured, mean Euclidean error, mean transformed error over the selected layers)
    of one refresh record; the means are NaN when the refresh selected no layer."""
    layers = [k.removeprefix("gift/selected/") for k in refresh if k.startswith("gift/selected/")]
    chosen = [fqn for fqn in layers if refresh[f"gift/selected/{fqn}"]]
    if not chosen:
        return 0, len(layers), math.nan, math.nan
    euclidean = sum(refresh[f"gift/err_euclidean/{fqn}"] for fqn in chosen) / len(chosen)
    transformed = sum(refresh[f"gift/err_transformed/{fqn}"] for fqn in chosen) / len(chosen)
    return len(chosen), len(layers), euclidean, transformed


def closer_to_fp32(gift_val: float, plain_val: float, fp32_val: float) -> str:
    """Which low-bit arm ended nearer the fp32 arm in validation loss, as measured. The sentence
    gives both distances, since on one short seed a small gap may be noise."""
    d_gift, d_plain = abs(gift_val - fp32_val), abs(plain_val - fp32_val)
    if d_gift == d_plain:
        return f"GIFT and plain low-bit are equally close to fp32 (|difference| {d_gift:.5f} each)"
    nearer, farther = ("GIFT", "plain low-bit") if d_gift < d_plain else ("plain low-bit", "GIFT")
    return (f"{nearer} is closer to fp32 than {farther}: |GIFT - fp32| = {d_gift:.5f}, "
            f"|plain - fp32| = {d_plain:.5f}, as measured on one seed and one short run (no noise "
            "estimate: not a significance claim)")


def _report(arms: dict[str, RunResult], fmt: str) -> None:
    gift = arms["GIFT"]
    chosen = resolved_choices(gift.output)
    print(f"\nGIFT geometry {GEOMETRY} -> {chosen['geometry']}, selection metric -> {chosen['select_metric']} "
          "(chosen from the optimizer that steps the managed weights)")
    _table("Training loss per step", {label: run.losses() for label, run in arms.items()})
    validation = {label: _validation(run) for label, run in arms.items()}
    _table("Validation loss", validation)

    rewrite = next((line for line in gift.output.splitlines() if "GIFT rewrite:" in line), None)
    if rewrite is not None:  # graph_trainer: what the pass did to the traced step
        print("\nGraph rewrite of the GIFT arm (GPU pass list, FSDP bucketing on):\n  "
              + rewrite.split("GIFT rewrite: ", 1)[1])
        passes = [line.strip() for line in gift.output.split("graph passes:", 1)[1].splitlines()[1:12]
                  if line.strip()[:1].isdigit()]
        print("  passes: " + ", ".join(p.split(". ", 1)[1] for p in passes))
    print(f"  GIFT plan version {gift.last('gift/plan_version'):.0f} (changes of what the graph carries), "
          f"{gift.last('gift/selection_changes'):.0f} selection change(s) (data in the graph); "
          f"the step was retraced {gift.output.count('retracing the step')} time(s) over all ranks")

    refresh = last_measured_refresh(gift)
    if refresh is None:
        print("\nNo GIFT refresh measured per-layer errors (the run is too short): no per-layer errors.")
    else:
        layers = [k.removeprefix("gift/selected/") for k in refresh if k.startswith("gift/selected/")]
        print(f"\nPer-layer relative round-trip error at {fmt}, GIFT arm's last refresh that measured layers "
              f"(step {refresh['gift/refresh_step']:.0f}), in the {chosen['select_metric']} selection metric: "
              "Euclidean = plain low-bit's codec, transformed = GIFT's map")
        width = max(map(len, layers))
        print(f"  {'layer':<{width}}  {'Euclidean':>9}  {'transformed':>11}  selected")
        for fqn in layers:
            print(f"  {fqn:<{width}}  {refresh[f'gift/err_euclidean/{fqn}']:9.4f}  "
                  f"{refresh[f'gift/err_transformed/{fqn}']:11.4f}  {'yes' if refresh[f'gift/selected/{fqn}'] else 'no'}")
        n_sel, n_all, euclidean, transformed = selected_errors(refresh)
        print(f"  {'mean (measured)':<{width}}  {refresh['gift/err_euclidean_mean']:9.4f}  "
              f"{refresh['gift/err_transformed_mean']:11.4f}  {n_sel}/{n_all}")
        print(f"  {'mean (selected)':<{width}}  {euclidean:9.4f}  {transformed:11.4f}")

    print("\nSummary (same seed, init and data order; bytes per step and rank of the whole gradient, counted where "
          "handed to the collectives)")
    # the whole gradient, every collective of the step (`telemetry.whole_gradient`): GIFT's and
    # the buckets without a managed weight (embedding, head) that travel as they were
    untouched = gift.last("gift/untouched_bytes_per_step")
    fp32_bytes = gift.last("gift/baseline_bytes_per_step") + untouched
    print(f"  {'arm':<22}  {'final loss':>10}  {'val loss':>9}  {'MB/step':>8}")
    for label, run in arms.items():
        final = run.losses()[max(run.losses())]
        val = validation[label][max(validation[label])] if validation[label] else math.nan
        # The GIFT-off run has no GIFT collective to count at; GIFT's counter records the fp32
        # bytes of the same collectives alongside the bytes it sent.
        sent = run.last("gift/wire_bytes_per_step") + untouched if label != "fp32" else fp32_bytes
        print(f"  {ARM_NAMES[label].format(fmt=fmt):<22}  {final:10.5f}  {val:9.5f}  {sent / 1e6:8.3f}")
    if refresh is not None:
        print(f"  round-trip error over the {n_sel} layers GIFT selected: plain (Euclidean) {euclidean:.4f}, "
              f"GIFT (transformed) {transformed:.4f}")
    if "plain" in arms:
        plain_wire = arms["plain"].last("gift/wire_bytes_per_step") + untouched
        gift_wire = gift.last("gift/wire_bytes_per_step") + untouched
        print(f"  bytes: GIFT {fp32_bytes / gift_wire:.2f}x fewer than fp32, plain low-bit "
              f"{fp32_bytes / plain_wire:.2f}x (GIFT / plain = {gift_wire / plain_wire:.4f})")
    if "fp32" in arms and "plain" in arms:
        last = {label: validation[label][max(validation[label])] for label in arms}
        print("  " + closer_to_fp32(last["GIFT"], last["plain"], last["fp32"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--config", default=GIFT_CONFIGS[0], choices=GIFT_CONFIGS, help="GIFT config function")
    parser.add_argument("--format", default=DEFAULT_FORMAT, choices=FORMATS,
                        help=f"wire format of GIFT and plain low-bit (default {DEFAULT_FORMAT})")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also run plain low-bit and fp32 (default on)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.nproc < 1:
        parser.error("--steps and --nproc must be positive")

    common = [f"--training.steps={args.steps}", f"--validator.freq={min(VALIDATE_EVERY, args.steps)}"]
    # A refresh is reported with the step after it, so the last one must come before the end.
    low_bit = [*common, f"--gift.format={args.format}", f"--gift.refresh-every={max(1, min(REFRESH_EVERY, args.steps - 1))}"]
    timeout_s = 600 + 10 * args.steps
    start = time.perf_counter()
    arms = {"GIFT": _stream_run("GIFT", args.config, [*low_bit, f"--gift.geometry={GEOMETRY}"], args.nproc, timeout_s)}
    if args.compare:
        # Same trainer, same codec and bytes, no map: what GIFT's geometry adds over plain low-bit.
        arms["plain"] = _stream_run("plain", args.config, [*low_bit, "--gift.geometry=none"], args.nproc, timeout_s)
        arms["fp32"] = _stream_run("fp32", args.config.replace("_gift_", "_nogift_"), common, args.nproc, timeout_s)
    _report(arms, args.format)
    print(f"\nTotal wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
