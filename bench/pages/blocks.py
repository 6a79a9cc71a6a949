"""Generated blocks that read committed results files of their own (some next to results.json):
the formats table (computed from `gift_compile.codec`), the cost of the cross-rank checks
(`bench/results/cluster/plan_check.txt`), `make demo`'s output (`bench/results/cluster/demo.json`), the torchtitan
runs (`bench/results/cluster/torchtitan_runs.json`), the skip table (the suite's own `require` calls), the
fault table, the soak, the second hop, the HSDP step model and the memory bullet. `bench.pages.readme`
places and checks them with its results.json blocks: a table typed by hand went stale (the soak
row kept an older run's figures next to the generated block), and a skip table typed by hand
missed skips the suite could take.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gift_compile.codec import FormatSpec, dequantize, quantize
from bench.lib.paths import ROOT, RESULTS

FIDELITY, CLUSTER = RESULTS / "fidelity", RESULTS / "cluster"

TESTS = ROOT / "tests"
SECOND_HOP, SOAK = FIDELITY / "second_hop.json", CLUSTER / "soak.json"
MEMORY_SECOND_HOP = FIDELITY / "memory_second_hop.json"
GIB = 2 ** 30
# `bench.cluster.fault_table` on this checkout and on the last one before the end-of-backward checks
FAULTS, FAULTS_BEFORE = (CLUSTER / f for f in ("fault_table.json", "fault_table_before.json"))


# ---- formats -------------------------------------------------------------------------------

# (label, block scale, [(format, scaling, block_size), ...]): one row per format family, the
# scalings/blocks of a row shown side by side; what the table measures is computed below.
FORMAT_ROWS: list[tuple[str, str, list[tuple[str, str, int]]]] = [
    ("fp32", "-", [("fp32", "row", 32)]),
    ("bf16", "-", [("bf16", "row", 32)]),
    ("fp8_e4m3 (tensor / row / block 32)", "fp32 power of two",
     [("fp8_e4m3", "tensor", 32), ("fp8_e4m3", "row", 32), ("fp8_e4m3", "block", 32)]),
    ("fp8_e5m2 (tensor / row / block 32)", "fp32 power of two",
     [("fp8_e5m2", "tensor", 32), ("fp8_e5m2", "row", 32), ("fp8_e5m2", "block", 32)]),
    ("mxfp8 (E4M3 elements)", "E8M0 per 32", [("mxfp8", "row", 32)]),
    ("nvfp4 (E2M1 elements)", "E4M3 per 16 + fp32", [("nvfp4", "row", 32)]),
    ("int6, block 16 / 32", "E4M3 per block + fp32", [("int6", "row", 16), ("int6", "row", 32)]),
    ("int4, block 16 / 32", "E4M3 per block + fp32", [("int4", "row", 16), ("int4", "row", 32)]),
    ("int3, block 16 / 32", "E4M3 per block + fp32", [("int3", "row", 16), ("int3", "row", 32)]),
    ("mxint4", "E8M0 per 32", [("mxint4", "row", 32)]),
    ("int2, block 16 / 32", "E4M3 per block + fp32", [("int2", "row", 16), ("int2", "row", 32)]),
    ("ternary, block 16 / 32", "E4M3 per block + fp32", [("ternary", "row", 16), ("ternary", "row", 32)]),
]
SHAPE, SEED, SR_SEED = (256, 1024), 0, 1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _num(x: float) -> str:
    """Up to 4 decimals without trailing zeros (8.0001, 8.0312, 9, 4.5)."""
    return f"{x:.4f}".rstrip("0").rstrip(".")


def formats(_: dict) -> str:
    """The formats table, computed on each check: one round trip of standard Gaussian data
    (the shape and seed `tests/test_formats.py` bounds), with round-to-nearest and stochastic
    rounding, and the exact wire bits per element (payload + every scale) for that shape."""
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(SEED))
    lines = [f"Standard Gaussian data, {SHAPE[0]} x {SHAPE[1]}, seed {SEED}: relative L2 error of one round trip "
             f"with round-to-nearest and with `stochastic_rounding=True` (seed {SR_SEED}), and the exact wire "
             "accounting (payload + every scale) for that shape (`tests/test_formats.py` bounds the same errors):",
             "", "| format | block scale | rel. L2 error | with SR | bits / element on the wire |",
             "|---|---|---|---|---|"]
    for label, scale, cases in FORMAT_ROWS:
        err, sr, bits = [], [], []
        for fmt, scaling, block in cases:
            err.append(_num(_rel(dequantize(quantize(x, fmt, scaling=scaling, block_size=block)), x)))
            sr.append("exact" if fmt == "fp32" else _num(_rel(dequantize(quantize(
                x, fmt, scaling=scaling, block_size=block, stochastic_rounding=True, seed=SR_SEED)), x)))
            bits.append(_num(FormatSpec(fmt, scaling, block).bits_per_element(SHAPE[1], SHAPE[0])))
        lines.append(f"| {label} | {scale} | {' / '.join(err)} | {' / '.join(sr)} | {' / '.join(bits)} |")
    return "\n".join(lines)


# ---- the cost of the checks ----------------------------------------------------------------

def _field(text: str, pattern: str) -> re.Match:
    m = re.search(pattern, text, re.M)
    if m is None:
        raise ValueError(f"bench/results/cluster/plan_check.txt: no line matches {pattern!r} (was its output changed?)")
    return m


def plan_check(_: dict) -> str:
    """The checks' cost table, read from `bench.cluster.plan_check`'s committed output."""
    t = (CLUSTER / "plan_check.txt").read_text()
    cmd = _field(t, r"^# (.+?)  \((.+)\)$")
    bucket = _field(t, r"^bucket: \[(\d+), (\d+)\] (\S+) (\S+) over (\d+) gloo ranks, (\d+) repeats")
    sent = _field(t, r"bytes handed to the all_to_all: (\d+), of which headers (\d+) \(([\d.]+)%\)")
    coll = float(_field(t, r"bucket collective: ([\d.]+) ms")[1])

    def cost(label: str) -> tuple[float, str]:
        m = _field(t, rf"{re.escape(label)}: ([\d.]+) ms \(([\d.]+)% of the bucket\)")
        return float(m[1]), m[2]

    table, desc = cost("fingerprint table (plan_check='first', every eager call)"), cost(
        "fingerprint table + descriptions (plan_check='always')")
    flag, checksum = cost("non-finite flag of a passthrough item of this size"), cost(
        "replica checksum of a gradient of this size + all-reduce")
    load = _field(t, r"load average during the run: ([\d.]+) \((\d+) cores\)")
    rows, cols = int(bucket[1]), int(bucket[2])
    elements = f"{rows * cols / 1e6:.1f} M"
    return "\n".join([
        f"`{cmd[1]}` ({cmd[2]}): {bucket[5]} gloo ranks, a [{rows}, {cols}] {bucket[3]} {bucket[4]} bucket, medians of "
        f"{bucket[6]} repeats at load {load[1]} on {load[2]} cores (`bench/results/cluster/plan_check.txt`):", "",
        "| check | when | cost |", "|---|---|---|",
        "| header (fingerprint + non-finite flag) | every bucket, eager and compiled | "
        f"16 bytes per rank ({sent[2]} of "
        f"{int(sent[1]):,} bytes: {sent[3]}%) plus a comparison fused into the decode side |",
        f"| fingerprint table | every eager bucket call (FSDP2/DDP hooks, GIFT's eager per-layer sync, the public API) "
        f"| {table[0]:.2f} ms ({table[1]}% of the {coll:.0f} ms eager bucket): one [world, 2] int64 all-reduce and a "
        "host read |",
        f"| descriptions (`all_gather_object`) | a plan's first call and any mismatch; every call with "
        f"`plan_check=\"always\"` | {desc[0]:.1f} ms with the table ({desc[1]}%) |",
        f"| non-finite flag of passthrough items | every bucket | an `isfinite` reduction over the passthrough bytes: "
        f"{flag[0]:.0f} ms for {elements} fp32 elements eagerly ({flag[1]}% of a bucket of that size; real buckets "
        "pass "
        "norms and biases through, embeddings when excluded); compiled cores fuse it with the byte copy (not measured "
        "apart) |",
        "| replica checksum | at the end of each synchronising backward of GIFT's own sync (plain module) | one "
        "read of each managed "
        f"gradient and a [world, layers, 2] all-reduce: {checksum[0]:.0f} ms per {elements} gradient elements eagerly "
        f"({checksum[1]}%) |"])


# ---- make demo and the torchtitan runs -----------------------------------------------------

def _demo() -> dict:
    return json.loads((CLUSTER / "demo.json").read_text())


def _find(text: str, pattern: str) -> re.Match:
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"bench/results/cluster/demo.json: the output has no line matching {pattern!r}")
    return m


def demo(_: dict) -> str:
    """`make demo`'s committed output, with the sentence that reads it (every number in the
    sentence is parsed from the output, so the two cannot disagree)."""
    d = _demo()
    out = d["output"]
    err = _find(out, r"round-trip error over the (\d+) layers GIFT selected: plain \(Euclidean\) ([\d.]+), "
                     r"GIFT \(transformed\) ([\d.]+)")
    dist = _find(out, r"\|GIFT - fp32\| = ([\d.]+), \|plain - fp32\| = ([\d.]+)")
    ratio = _find(out, r"bytes: GIFT ([\d.]+)x fewer than fp32, plain low-bit ([\d.]+)x")
    wall = _find(out, r"Total wall time: (\d+) s")
    gift, plain = float(dist[1]), float(dist[2])
    closer = "nearer to" if gift < plain else "farther from"
    return (f"Run on {d['date']} by `{d['make']}` (`{d['command']}`; {d['machine']}; {wall[1]} s wall for the three "
            f"runs); source: {d['source']}. On this seed GIFT's map cuts the round-trip error of the {err[1]} layers "
            f"it selected from {err[2]} to {err[3]} at the same bytes as plain low-bit ({ratio[1]}x / {ratio[2]}x "
            f"fewer than fp32); GIFT's final validation loss is {closer} fp32 than plain's by {abs(plain - gift):.5f} "
            "(one seed, one short run: the loss does not separate the two low-bit arms):\n\n```\n" + out + "```")


def demo_summary(_: dict) -> str:
    """The summary lines of `make demo`'s committed output (what the README shows it prints)."""
    d = _demo()
    out = d["output"]
    start, end = out.index("Summary ("), out.index("Total wall time")
    return f"```\n{out[start:end].rstrip()}\n```\n(`{d['make']}`, {d['date']}, `bench/results/cluster/demo.json`)"


def torchtitan_runs() -> dict[str, dict]:
    """The torchtitan runs the guide quotes, by block name."""
    return json.loads((CLUSTER / "torchtitan_runs.json").read_text())["runs"]


def torchtitan_run(name: str) -> Callable[[dict], str]:
    """The block renderer of one committed torchtitan run: its recorded text and provenance."""
    def render(_: dict) -> str:
        run = torchtitan_runs()[name]
        return (f"{run['text']}\n\n(Recorded {run['date']} from {run['command']}, commit {run['commit']}; "
                f"committed in `bench/results/cluster/torchtitan_runs.json`.)")
    render.__doc__ = f"The torchtitan run {name!r} from bench/results/torchtitan_runs.json."
    return render


# ---- results files of their own ------------------------------------------------------------

def second_hop(_: dict) -> str:
    """The error-feedback-on-both-hops bullet, from `bench.fidelity.second_hop`'s own results file."""
    d = json.loads(SECOND_HOP.read_text())
    arms = list(d["arms"])
    lines = [f"* **Error feedback on both all-reduce hops** (`{d['command']}`: {d['world']} gloo ranks, each holding "
             f"one half-batch gradient of the {d['reference']['optimizer']} reference model's {d['layers']} managed "
             f"layers, {d['batches']} held-out batches cycled for {d['steps']} steps; {d['metric']}; GIFT = low-rank "
             f"K-FAC map, r32, fixed; arms in this order: {'; '.join(f'`{a}`' for a in arms)}):"]
    for fmt, by in d["errors"].items():
        lines.append("  " + "; ".join(f"{fmt} {'Euclidean' if geo == 'euclidean' else 'GIFT'}: "
                                      + " / ".join(f"{by[geo][a]:.4f}" for a in arms) for geo in by) + ".")
    return "\n".join(lines)


def soak(_: dict) -> str:
    """The soak paragraph, from `bench.cluster.soak`'s own results file (per rank: resident memory
    after warm-up and at the end, its slope, graphs compiled, bytes against the accounting)."""
    d = json.loads(SOAK.read_text())
    ranks = d["ranks"]
    r0 = ranks[0]
    mem = " and ".join(f"{r['rss_mib_after_warmup']:.1f} -> {r['rss_mib_end']:.1f} MiB (rank {r['rank']})" for r in ranks)
    slopes = " and ".join(f"{r['rss_slope_mib_per_1000_steps']:.1f}" for r in ranks)
    off = sum(r["n_steps_off_the_accounting"] for r in ranks)
    flags = sum(r["totals"]["nonfinite"] + r["totals"]["mismatch"] for r in ranks)
    return (f"Soak (`{d['command']}`): {len(ranks)} gloo ranks, a compiled MLP with LayerNorms, GIFT FP8 + error "
            f"feedback, {r0['refreshes']} refreshes, {r0['checkpoints']} DCP checkpoints: resident memory {mem} between "
            f"step {r0['warmup_steps']} and step {r0['steps']:,} (least-squares slope {slopes} MiB per 1,000 steps), "
            f"{max(r['recompiles_after_warmup'] for r in ranks)} recompiles after warm-up "
            f"({max(r['graphs_end'] for r in ranks)} graph(s) in all); {off} of the {r0['steps']:,} steps on any rank differed from "
            f"the accounted bytes ({r0['accounted_bytes_per_step']:,} per step: the managed all-reduces by their plans "
            f"plus the plain bucket), {r0['totals']['plain_calls']:,} plain-sync launches on rank 0, {flags} health "
            "flags.")


def faults(_: dict) -> str:
    """Where each injected fault surfaced, per path and step driver, before and after the
    checks moved to the end of the backward (`bench.cluster.fault_table`'s two results files)."""
    now, before = (json.loads(f.read_text()) for f in (FAULTS, FAULTS_BEFORE))
    old = {(r["fault"], r["path"], r["driver"]): r for r in before["rows"]}

    def cell(r: dict) -> str:
        return f"{r['where']}; replicas {'agree' if r['replicas_agree'] else 'differ'}" + (
            "" if r["finite"] else "; parameters non-finite")

    lines = [f"Where each fault surfaced on every rank (`python -m bench.cluster.fault_table`, 2 gloo ranks; before: "
             f"checkout {before['commit']}, now: {now['commit']}; `silent`: nothing raised). Driver `optimizer`: "
             "`apply(..., optimizer=opt)`; `step`: `apply` without it and `gift_compile.step(model)` after each step.",
             "", "| fault | path | driver | before | now |", "|---|---|---|---|---|"]
    for r in now["rows"]:
        b = old.get((r["fault"], r["path"], r["driver"]))
        lines.append(f"| {r['fault']} | {r['path']} | {r['driver']} | {cell(b) if b else 'not run'} | {cell(r)} |")
    return "\n".join(lines)


def memory(r: dict) -> str:
    """The memory bullet: GIFT's state per rank from real `GiftState` objects (results.json),
    and the second-hop residual from `bench/results/fidelity/memory_second_hop.json`."""
    rows = r["memory"]["rows"]

    def row(model: str, world: int, config: str, src: list[dict] = rows) -> dict:
        return next(x for x in src if (x["model"], x["world"], x["config"]) == (model, world, config))

    def gib(model: str, world: int, config: str, src: list[dict] = rows) -> float:
        return row(model, world, config, src)["gift_total"] / GIB

    def part(model: str, world: int, config: str, key: str) -> float:
        return row(model, world, config)["gift"][key] / GIB

    defaults, ef = "GIFT defaults (lowrank r32, sketch statistics)", "GIFT defaults + error feedback (fp32 residual)"
    fp8, int4 = "GIFT + error feedback, fp8_e4m3 residual", "GIFT + error feedback, int4 residual"
    first = "first version: dense statistics + error feedback (fp32)"
    fsdp = next(x["fsdp_per_rank"] for x in rows if (x["model"], x["world"]) == ("Llama-3-8B", 64)) / GIB
    hop = json.loads(MEMORY_SECOND_HOP.read_text())["rows"]
    both32, both4 = ("GIFT + error feedback on both all-reduce hops, fp32 residuals",
                     "GIFT + error feedback on both all-reduce hops, int4 residuals")
    big, small = "Llama-3-8B", "Llama-600M"
    return (f"* **Memory per rank** (`bench.fidelity.memory`: real `GiftState` objects for the model's managed layers on the "
            f"meta device, `GiftState.memory_bytes()`): {big} on 64 ranks — GIFT defaults {gib(big, 64, defaults):.2f} "
            f"GiB (statistics {part(big, 64, defaults, 'statistics'):.2f}: sketches, one per distinct input; transforms "
            f"{part(big, 64, defaults, 'transforms'):.2f}; probes {part(big, 64, defaults, 'probes'):.2f}); with error "
            f"feedback the residual is the rank's full local gradient: {gib(big, 64, ef):.1f} GiB with an fp32 "
            f"residual, {gib(big, 64, fp8):.1f} GiB in fp8_e4m3, {gib(big, 64, int4):.1f} GiB in int4 (first version "
            f"{gib(big, 64, first):.1f} GiB). FSDP's sharded params + grads + AdamW state is {fsdp:.2f} GiB per rank on "
            f"64 ranks. {small} on 8 ranks: {gib(small, 8, defaults):.2f} GiB (EF: {gib(small, 8, ef):.2f} fp32 / "
            f"{gib(small, 8, fp8):.2f} fp8 / {gib(small, 8, int4):.2f} int4; first version {gib(small, 8, first):.2f}). "
            f"On both all-reduce hops (`bench/results/fidelity/memory_second_hop.json`) the owner's second-hop residual adds "
            f"1/world of the first-hop one: {big} fp32 {gib(big, 8, ef, hop):.2f} -> {gib(big, 8, both32, hop):.2f} GiB "
            f"on 8 ranks, {gib(big, 64, both32, hop):.2f} on 64; int4 residuals {gib(big, 8, int4, hop):.2f} -> "
            f"{gib(big, 8, both4, hop):.2f} / {gib(big, 64, both4, hop):.2f} GiB.")


# ---- the test tiers ------------------------------------------------------------------------

def _tiers() -> object:
    """tests/tiers.py, loaded by path (tests/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gift_test_tiers", TESTS / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiers(_: dict) -> str:
    """Which fast test covers each row of the feature table, and what only `make test-full` runs."""
    t = _tiers()
    lines = ["| feature | `make test` covers it with |", "|---|---|"]
    lines += [f"| {row} | {', '.join(f'`tests/{e}`' for e in entries)} |" for row, entries in t.FEATURES.items()]
    lines += ["", "Only `make test-full` runs these (each repeats a fast check on more ranks or launches):", "",
              "| tests | why not in `make test` |", "|---|---|"]
    lines += [f"| `tests/{name}` | {why} |" for name, why in {**t.FULL_FILES, **t.FULL_TESTS}.items()]
    return "\n".join(lines)


# ---- the skips -----------------------------------------------------------------------------

def require_calls(tests: Path = TESTS) -> Iterator[tuple[str, str, str, str]]:
    """`(where, helper, module, reason)` for every `require` / `require_data_package` call in the
    suite: where is `tests/<file>` for a module-level call (the whole file skips) or
    `tests/<file>::<test>` for one inside a test."""
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        scopes: list[tuple[ast.AST, str]] = [(tree, f"tests/{path.name}")]
        scopes += [(f, f"tests/{path.name}::{f.name}") for f in tree.body if isinstance(f, ast.FunctionDef)]
        for scope, where in scopes:
            body = [n for n in scope.body if not isinstance(n, ast.FunctionDef)] if scope is tree else [scope]
            for node in (n for b in body for n in ast.walk(b)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("require", "require_data_package") and len(node.args) == 2
                        and all(isinstance(a, ast.Constant) for a in node.args)):
                    yield where, node.func.id, node.args[0].value, node.args[1].value


def skips(_: dict) -> str:
    """The skip table: every skip the suite can take, read from its `require` calls."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for where, helper, module, reason in require_calls():
        if where.startswith("tests/test_ci_requirements.py"):
            continue  # the tests of `require` itself ask for modules that never exist
        rows.setdefault((helper, module, reason), [])
        if where not in rows[(helper, module, reason)]:
            rows[(helper, module, reason)].append(where)
    lines = ["| skipped | when | reason shown |", "|---|---|---|"]
    for (helper, module, reason), wheres in rows.items():
        when = f"`{module}` does not import" if helper == "require" else f"the `{module}` package is not on the path"
        lines.append(f"| {', '.join(f'`{w}`' for w in wheres)} | {when} | {reason} |")
    return "\n".join(lines)
