"""`python -m bench.run [--quick]`: run the GIFT benchmarks and write REPORT.md, PNGs, results.json.

Sections (each its own module): wire bytes, the reference model and its gradients,
fidelity, kernel overhead, the codec against its minimum traffic, 2-rank convergence, the step-time projection and the memory
table. Progress is printed as it goes; results.json is rewritten after every section, so an
interrupted run keeps what it finished. `--merge` keeps the other sections of an existing
results.json in `--out` and replaces only the sections that run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from bench.fidelity import codec_minimum, round_trip as fidelity, memory, overhead
from bench.convergence import runner as convergence, arms as convergence_arms, summary as convergence_summary
from bench.pages import plots, report
from bench.lib import reference, wire
from bench.step_model import cpu as step_model
from bench.lib.settings import BenchSettings, profile
from gift_compile.torchtitan_ext.cpu import corpus
from bench.lib.paths import RESULTS

SECTIONS = ("wire", "fidelity", "overhead", "codec", "convergence", "step_model", "memory")
# the codec measurement of the code before the codec work, shown beside every later run
CODEC_BEFORE = RESULTS / "fidelity" / "codec_before.json"
DEFAULT_OUT = RESULTS


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the quick profile (a few minutes, one seed)")
    p.add_argument("--profile", choices=("smoke", "quick", "full"), default=None,
                   help="sizes of the run (default: full; --quick means quick; smoke is for CI)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for REPORT.md, PNGs, results.json")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the trained reference model is cached (default: <corpus cache>/bench)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the main process")
    p.add_argument("--conv-compile", action="store_true", help="torch.compile the convergence models")
    p.add_argument("--merge", action="store_true",
                   help="start from --out/results.json and replace only the sections that run (its meta records both)")
    p.add_argument("--tuning", type=Path, nargs="+", default=[],
                   help="JSON files of `python -m bench.convergence.tune` runs to include in the report (section 5.2)")
    p.add_argument("--sweep", type=Path, nargs="+", default=[],
                   help="JSON files of `python -m bench.fidelity.sweep` to include in the report (section 2.5)")
    p.add_argument("--conv-seeds", default=None, help="comma-separated seeds of the convergence section (default: the profile's)")
    p.add_argument("--conv-arms", default=None,
                   help="convergence arms instead of the profile's: 'muon=fp32,euclid-int2;adamw=fp32,gift-int2'")
    p.add_argument("--convergence-runs", type=Path, nargs="+", default=None,
                   help="summarise the convergence section from these runs files (one JSON line per finished run, "
                        "as a convergence run streams them; e.g. the all-reduce and the reduce-scatter study) "
                        "instead of training; partial files give fewer seeds")
    p.add_argument("--from-json", type=Path, default=None,
                   help="only re-render REPORT.md and the figures into --out from an earlier results.json")
    args = p.parse_args(argv)
    if args.quick and args.profile not in (None, "quick"):
        p.error("--quick conflicts with --profile " + args.profile)
    args.profile = "quick" if args.quick else (args.profile or "full")
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    return args


class _Progress:
    """Timestamped progress lines on stdout (flushed: the run is long and often piped)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[bench {time.perf_counter() - self.start:6.0f}s] {message}", flush=True)


def _write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    """Run the selected sections; returns the results dict that REPORT.md was written from."""
    args = _parse(argv)
    if args.from_json is not None:
        return _render(_attach(json.loads(args.from_json.read_text()), args), args.out)
    settings: BenchSettings = profile(args.profile)
    if args.conv_compile:
        settings = dataclasses.replace(settings, convergence=dataclasses.replace(settings.convergence, compile=True))
    if args.conv_seeds or args.conv_arms:
        conv = settings.convergence
        seeds = tuple(int(x) for x in args.conv_seeds.split(",")) if args.conv_seeds else conv.seeds
        arms = tuple((opt, tuple(a.split(","))) for opt, a in (part.split("=") for part in args.conv_arms.split(";"))) \
            if args.conv_arms else conv.arms
        for _, names in arms:
            for name in names:
                convergence_arms.parse_arm(name)  # raises naming an unknown arm before any run starts
        settings = dataclasses.replace(settings, convergence=dataclasses.replace(conv, seeds=seeds, arms=arms))
    only = set(args.only.split(","))
    torch.set_num_threads(args.threads or settings.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = _Progress()
    results: dict = {"meta": {
        "command": " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "profile": settings.profile, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg()[0], "gpu": torch.cuda.is_available(), "settings": settings.to_dict(),
    }}
    json_path = out / "results.json"
    if args.merge:
        if not json_path.exists():
            raise SystemExit(f"--merge: {json_path} does not exist")
        earlier = json.loads(json_path.read_text())
        kept = {k: v for k, v in earlier.items() if k not in ("meta", "plots") and k not in only
                and not (k == "reference" and "fidelity" in only)}
        results["meta"]["merged_into"] = {"command": earlier["meta"]["command"], "started": earlier["meta"]["started"],
                                          "profile": earlier["meta"]["profile"], "kept": sorted(kept)}
        results["meta"]["sections"] = {k: v for k, v in earlier["meta"].get("sections", {}).items() if k in kept}
        results.update(kept)
    # which command, profile and load produced each section (sections merged from several runs)
    produced = {"command": results["meta"]["command"], "profile": settings.profile,
                "started": results["meta"]["started"], "loadavg_start": results["meta"]["loadavg_start"]}
    results["meta"].setdefault("sections", {}).update(
        {k: produced for k in SECTIONS if k in only} | ({"reference": produced} if "fidelity" in only else {}))
    log(f"profile {settings.profile}: sections {', '.join(s for s in SECTIONS if s in only)}; output {out}")
    paths = corpus.prepare()

    if "wire" in only:
        log("wire bytes per step")
        results["wire"] = wire.run()
        _write_json(json_path, results)

    if "fidelity" in only:
        log("reference model")
        model, record = reference.reference_model(settings.reference, paths, log, args.cache_dir)
        log("collecting held-out gradients and K-FAC factors")
        samples = reference.collect_samples(model, settings.fidelity, paths, log)
        fs = settings.fidelity
        results["reference"] = {
            **{k: v for k, v in record.items() if k != "losses"},
            "settings": dataclasses.asdict(settings.reference),
            "cache": str(reference.cache_path(settings.reference, paths, args.cache_dir)),
            "heldout_batches": fs.heldout_batches, "micro_batches": fs.micro_batches, "seq_len": fs.seq_len,
            "layers": len({x.name for x in samples}),
        }
        log(f"fidelity: {len(samples)} layer samples x {len(settings.formats)} formats x "
            f"{len(settings.transforms)} transforms; multi-rank P = {fs.ranks}")
        results["fidelity"] = fidelity.run(samples, settings.formats, settings.transforms, fs, log)
        del samples, model
        _write_json(json_path, results)

    if "overhead" in only:
        log(f"overhead ({'compiled' if settings.overhead.compile else 'eager'} kernels, CPU)")
        results["overhead"] = overhead.run(settings.overhead, log)
        _write_json(json_path, results)

    if "codec" in only:
        log(f"codec at the memory-traffic limit ({settings.codec.world} fake ranks, generated kernels vs minimum)")
        results["codec"] = codec_minimum.run(settings.codec, CODEC_BEFORE, log)
        _write_json(json_path, results)

    if "convergence" in only:
        log("convergence (2-rank gloo pretraining)")
        runs_path = out / "convergence_runs.jsonl"
        if args.convergence_runs is not None:
            runs = [json.loads(line) for f in args.convergence_runs for line in f.read_text().splitlines() if line.strip()]
            log(f"  summarising {len(runs)} finished runs from {', '.join(map(str, args.convergence_runs))} (no training)")
            for f in args.convergence_runs:  # the report's directory keeps a copy of every runs file it summarises
                if f.resolve().parent != out.resolve():
                    shutil.copyfile(f, out / f.name)
            results["convergence"] = convergence_summary.summarise(runs, settings.convergence)
        else:
            results["convergence"] = convergence.run(settings.convergence, paths, log, jsonl=runs_path)
        _write_json(json_path, results)

    if "step_model" in only:
        st = settings.step
        log(f"step-time model (projection; measures each arm's codec on {st.gpus} fake ranks)")
        results["step_model"] = step_model.run(step_model.StepModelInputs(gpus=st.gpus), st.model, st.model_config,
                                               st.arms, log)
        _write_json(json_path, results)

    if "memory" in only:
        log("memory per rank (GiftState and AdamW on the meta device)")
        results["memory"] = memory.run(settings.step.memory_models, settings.step.memory_worlds, log=log)
        _write_json(json_path, results)

    log("plots and report")
    results["meta"]["duration_s"] = time.perf_counter() - log.start
    _render(_attach(results, args), out)
    log(f"wrote {out / 'REPORT.md'}, {len(results['plots'])} figures and {json_path.name}")
    return results


def _attach(results: dict, args: argparse.Namespace) -> dict:
    """Add the tuning runs and fidelity sweeps named on the command line (each a JSON file
    written by its own module), replacing any attached earlier."""
    if args.tuning:
        results["tuning"] = [{**json.loads(p.read_text()), "file": p.name} for p in args.tuning]
    if args.sweep:
        results["sweeps"] = [{**json.loads(p.read_text()), "file": p.name} for p in args.sweep]
    return results


def _render(results: dict, out: Path) -> dict:
    """Figures, results.json and REPORT.md in `out` from a results dict."""
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = _plots(results, out)
    _write_json(out / "results.json", results)
    (out / "REPORT.md").write_text(report.render(results))
    return results


def _plots(results: dict, out: Path) -> dict[str, str]:
    made: dict[str, str] = {}
    if "fidelity" in results:
        fid = results["fidelity"]
        made["fidelity_heatmap"] = plots.fidelity_heatmap(fid, out)
        made["fidelity_layers"] = plots.fidelity_layers(fid, out)
        made["fidelity_eigen"] = plots.fidelity_eigen(fid, out)
        made["multirank"] = plots.multirank(fid, out)
    if "overhead" in results:
        made["overhead"] = plots.overhead(results["overhead"], out)
    if "wire" in results:
        made["wire"] = plots.wire(results["wire"], out)
    if "convergence" in results:
        made["convergence"] = plots.convergence(results["convergence"], out)
    if "step_model" in results:
        made["step_model"] = plots.step_model(results["step_model"], out)
    return made


if __name__ == "__main__":
    main()
