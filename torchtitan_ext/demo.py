"""`make demo`: GIFT FP8 gradient reduce-scatters in a real torchtitan run, next to GIFT off.

One command that shows what GIFT does to training, without a GPU or a download: it trains
the small Llama on the embedded Shakespeare corpus on 2 ranks (gloo on CPU; torchtitan
picks NCCL on CUDA) with GIFT on, then the same config with GIFT off (same seed, init and
data order), and prints the geometry and selection metric GIFT chose from the optimizer
(``--gift.geometry auto_by_optimizer``, as the shipped TOMLs set it), whether the losses
agree, how many bytes GIFT saves on the wire and which layers its geometry helps. It
launches exactly the torchrun command a user would (:func:`.runs.run_config`) and streams
the per-step JSONL records the run writes, so the numbers are torchtitan's own, not
re-derived here.

    python -m gift_compile.torchtitan_ext.demo [--nproc 2] [--steps N] [--no-compare]
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

# Both runs on 2 shared cores, cold Inductor cache: 270 s measured (GIFT on 195 s, of which
# 110 s to step 1; GIFT off 74 s), about half the ~10 min budget, as headroom for a busy box.
DEFAULT_STEPS = 100
REFRESH_EVERY = 10  # as in configs/*.toml
VALIDATE_EVERY = 20
GIFT_CONFIGS = ("llama3_debug_gift_graph", "llama3_debug_gift_fsdp2")
# As in configs/llama3_debug_gift*.toml: the geometry follows the optimizer (second_moment under
# the configs' AdamW, where the convergence study measured it ahead of plain low-bit and of K-FAC).
GEOMETRY = "auto_by_optimizer"
_RESOLVED = re.compile(r"GIFT: (geometry|select_metric) auto_by_optimizer -> (\w+)")


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


def _side_by_side(title: str, on: dict[int, float], off: dict[int, float] | None) -> None:
    header = f"  {'step':>4}  {'GIFT on':>8}" + (f"  {'GIFT off':>8}  {'on - off':>8}" if off is not None else "")
    print(f"\n{title}\n{header}")
    for step, value in sorted(on.items()):
        line = f"  {step:4d}  {value:8.5f}"
        if off is not None:
            ref = off.get(step, math.nan)
            line += f"  {ref:8.5f}  {value - ref:+8.5f}"
        print(line)


def resolved_choices(output: str) -> dict[str, str]:
    """What ``auto_by_optimizer`` resolved to in a run's log (`geometry`, `select_metric`);
    raises unless every rank logged the same choice for both."""
    found: dict[str, set[str]] = {"geometry": set(), "select_metric": set()}
    for key, value in _RESOLVED.findall(output):
        found[key].add(value)
    if any(len(values) != 1 for values in found.values()):
        raise RuntimeError(f"demo: the GIFT-on run did not log one resolved geometry and select_metric: {found}")
    return {key: values.pop() for key, values in found.items()}


def _report(gift: RunResult, nogift: RunResult | None) -> None:
    chosen = resolved_choices(gift.output)
    print(f"\nGIFT geometry {GEOMETRY} -> {chosen['geometry']}, selection metric -> {chosen['select_metric']} "
          "(chosen from the optimizer that steps the managed weights)")
    train_off = nogift.losses() if nogift else None
    _side_by_side("Training loss per step", gift.losses(), train_off)
    val_off = _validation(nogift) if nogift else None
    _side_by_side("Validation loss", _validation(gift), val_off)
    if train_off is not None:
        diffs = [abs(v - train_off[s]) for s, v in gift.losses().items() if s in train_off]
        last = max(train_off)
        print(f"\n  max |on - off| over {len(diffs)} steps: {max(diffs):.5f}; "
              f"at step {last}: {gift.losses()[last] - train_off[last]:+.5f}")

    wire, baseline = gift.last("gift/wire_bytes_per_step"), gift.last("gift/baseline_bytes_per_step")
    calls = gift.last("gift/collectives_per_step")
    print(f"\nBytes handed to GIFT's collectives per step and rank (counted at run time)\n"
          f"  GIFT {wire / 1e6:.3f} MB in {calls:.0f} collectives, where fp32 would have sent {baseline / 1e6:.3f} MB: "
          f"{baseline / wire:.2f}x fewer (bf16 would be 2.00x)")
    rewrite = next((line for line in gift.output.splitlines() if "GIFT rewrite:" in line), None)
    if rewrite is not None:  # graph_trainer: what the pass did to the traced step
        print("\nGraph rewrite (GPU pass list, FSDP bucketing on):\n  " + rewrite.split("GIFT rewrite: ", 1)[1])
        passes = [line.strip() for line in gift.output.split("graph passes:", 1)[1].splitlines()[1:12]
                  if line.strip()[:1].isdigit()]
        print("  passes: " + ", ".join(p.split(". ", 1)[1] for p in passes))
    print(f"  GIFT plan version {gift.last('gift/plan_version'):.0f} (per-layer selection/statistics switches); "
          f"the step was retraced {gift.output.count('retracing the step')} time(s) over all ranks")

    # A refresh measures only the layers it may (re)select: once a decision left none selected,
    # later refreshes until the next reselection measure none, so the report shows the last
    # refresh that measured layers.
    refresh = next((r for r in reversed(gift.records) if any(k.startswith("gift/selected/") for k in r)), None)
    if refresh is None:
        print("\nNo GIFT refresh measured per-layer errors (the run is too short): no per-layer errors.")
        return
    layers = [k.removeprefix("gift/selected/") for k in refresh if k.startswith("gift/selected/")]
    print(f"\nPer-layer relative round-trip error at the last refresh that measured layers "
          f"(step {refresh['gift/refresh_step']:.0f})")
    width = max(map(len, layers))
    print(f"  {'layer':<{width}}  {'Euclidean':>9}  {'transformed':>11}  selected")
    for fqn in layers:
        print(f"  {fqn:<{width}}  {refresh[f'gift/err_euclidean/{fqn}']:9.4f}  "
              f"{refresh[f'gift/err_transformed/{fqn}']:11.4f}  {'yes' if refresh[f'gift/selected/{fqn}'] else 'no'}")
    selected = sum(bool(refresh[f"gift/selected/{fqn}"]) for fqn in layers)
    print(f"  {'mean':<{width}}  {refresh['gift/err_euclidean_mean']:9.4f}  "
          f"{refresh['gift/err_transformed_mean']:11.4f}  {selected}/{len(layers)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--config", default=GIFT_CONFIGS[0], choices=GIFT_CONFIGS, help="GIFT config function")
    parser.add_argument("--format", default="fp8_e4m3", choices=FORMATS, help="GIFT wire format (default fp8_e4m3)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the GIFT-off config (default on)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.nproc < 1:
        parser.error("--steps and --nproc must be positive")

    common = [f"--training.steps={args.steps}", f"--validator.freq={min(VALIDATE_EVERY, args.steps)}"]
    # A refresh is reported with the step after it, so the last one must come before the end.
    refresh_every = max(1, min(REFRESH_EVERY, args.steps - 1))
    timeout_s = 600 + 10 * args.steps
    start = time.perf_counter()
    gift = _stream_run("GIFT on", args.config,
                       [*common, f"--gift.format={args.format}", f"--gift.geometry={GEOMETRY}",
                        f"--gift.refresh-every={refresh_every}"],
                       args.nproc, timeout_s)
    nogift = None
    if args.compare:
        nogift = _stream_run("GIFT off", args.config.replace("_gift_", "_nogift_"), common, args.nproc, timeout_s)
    _report(gift, nogift)
    print(f"\nTotal wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
