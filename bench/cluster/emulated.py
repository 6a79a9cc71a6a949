"""An emulated cluster on one Linux machine: measured step time of every communication arm side by side.

`python -m bench.cluster.emulated` (as root) builds N "nodes" as network namespaces of its own,
joined through a Linux bridge that lives in one more namespace of its own, and shapes each node's
link in both directions with `tc` (a token bucket at the given rate, optionally behind a netem
delay). Addresses exist only on the nodes' interfaces inside those namespaces (10.201.0.K+1/24);
nothing is configured in, or sent to, any other namespace. Ranks of one node talk over that
namespace's loopback (the NVLink stand-in: traffic to a node's own address never leaves it), ranks
of different nodes over the shaped link. One `torchrun --nnodes N --nproc-per-node g --node-rank K`
runs in each namespace (static rendezvous at node 0's address, gloo bound to the node's interface
by `GLOO_SOCKET_IFNAME`), so `LOCAL_WORLD_SIZE` is real and GIFT finds its two levels itself.

Each launch trains every selected arm of one framework path (`bench.cluster.emulated_worker`:
the same initialisation and data per arm) for `--warmup + --steps` steps; per arm the results
hold every step's time (the slowest rank's), the global-batch loss curve, the bytes the kernel
counted on each node's link over the timed steps and the bytes GIFT's own counters say it handed
to its collectives. After all arms ran, each (path, layout, rate) gets fp32's loss at 80% of the
run as a target, and every arm its time to reach it. Results: `bench/results/cluster/emulated.json`
(with the exact command, the rates, the layouts and the host), a plot of step time against link
rate (`emulated.png`) and a Markdown table (`render_table`, also the README's `cluster` block).

Namespaces are named `giftemu-<pid>-...` (`PREFIX`): every one this run made is removed on exit,
on an error and on SIGINT/SIGTERM, and at start every one whose owning process is gone (a killed
run) is removed. Without the privilege to create namespaces the run stops with that reason.

`--calibrate` measures fp32's unshaped step time and the bytes a node sends per step (DDP, the
first layout) and proposes the link rate at which fp32's communication takes as long as its
compute, and one 4x slower; `--rates auto` runs that calibration first and uses them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.cluster.emulated_worker import ARMS, LOCAL_BATCH, MODEL, PATHS, SEQ_LEN, embedding_share
from bench.lib.stats import median_ci

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "cluster" / "emulated.json"
# the results the README's `cluster` block renders: one file per command (DDP, HSDP)
README_RESULTS = (OUT, OUT.with_name("emulated_hsdp.json"), OUT.with_name("emulated_hsdp_nativehop.json"))
PREFIX = "giftemu-"
SUBNET = "10.201.0"  # the nodes' addresses: SUBNET.1 .. SUBNET.N, /24, only inside our namespaces
IFACE = "eth0"  # each node's link (inside its namespace)
BRIDGE = "br0"
MASTER_PORT = 29400
TBF = ("burst", "256kb", "latency", "100ms")  # the token bucket's depth and queue (DESIGN's hand-made cluster)
DEFAULT_ARMS = ("fp32", "bf16", "powersgd-4", "euclid-int2", "muon-int2-leaky-ef", "muon-int2-leaky-ef-flat",
                "muon-nvfp4")
TARGET_AT = 0.8  # the target loss: fp32's at this share of the run
# the targets a measured step is read against (at each shaped rate): the recipe's median step at
# most this share of fp32's, and within this share of the Euclidean arm at the same bits
RECIPE, EUCLID = "muon-int2-leaky-ef", "euclid-int2"
# each recipe arm with the Euclidean arm it is judged against (same bits, same hops): the default
# exchange, and HSDP with the shard hop left to FSDP2 (`GiftConfig.shard_hop="native"`)
RECIPE_PAIRS = ((RECIPE, EUCLID), (f"{RECIPE}-nativehop", f"{EUCLID}-nativehop"))
TARGET_VS_FP32, TARGET_VS_EUCLID = 0.6, 0.10


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built or a launch failed (the message says why)."""


# ---- pure pieces: parsing, statistics, rendering -------------------------------------------

def parse_layout(text: str) -> tuple[int, int]:
    """"NxG" -> (nodes, ranks per node); at least 2 nodes."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1:
        raise ValueError(f"layout {text!r}: expected NODESxRANKS with at least 2 nodes, e.g. 2x2 or 4x1")
    return int(m.group(1)), int(m.group(2))


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float | None:
    """A link rate as tc spells it ("25mbit", "1gbit", "500kbit") in bit/s; "none": unshaped (None)."""
    t = text.strip().lower()
    if t == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", t)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: expected a positive rate in bit, kbit, mbit or gbit (e.g. 100mbit), "
                         "'none' (unshaped) or 'auto' (calibrated)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def rate_label(bps: float | None) -> str:
    """The label of a rate: "none" for unshaped, else tc's spelling in whole mbit (or kbit)."""
    if bps is None:
        return "none"
    return f"{bps / 1e6:g}mbit" if bps >= 1e6 else f"{bps / 1e3:g}kbit"


def parse_arms(text: str | None, paths: Sequence[str]) -> dict[str, list[str]]:
    """The arms each of `paths` runs: `text` (comma-separated names of the worker's `ARMS`, or
    None for `DEFAULT_ARMS` plus the sharded paths' bf16-parameter arms), each on the paths it
    exists for. An unknown name, or one that runs on none of `paths`, raises."""

    for path in paths:
        if path not in PATHS:
            raise ValueError(f"path {path!r}: allowed {', '.join(PATHS)}")
    names = [n.strip() for n in text.split(",")] if text else [*DEFAULT_ARMS, "fp32-bf16p", "muon-int2-leaky-ef-bf16p"]
    for name in names:
        if name not in ARMS:
            raise ValueError(f"arm {name!r}: known arms are {', '.join(ARMS)}")
        if text and not set(ARMS[name].paths) & set(paths):
            raise ValueError(f"arm {name!r} runs on {', '.join(ARMS[name].paths)}, none of the paths asked "
                             f"({', '.join(paths)})")
    return {path: [n for n in dict.fromkeys(names) if path in ARMS[n].paths] for path in paths}


def _smoothed(losses: Sequence[float], window: int) -> list[float]:
    return [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]


def loss_window(total_steps: int) -> int:
    """The trailing window the loss curves are averaged over: a fifth of the run, at least 2 steps
    (every arm sees the same batches, but one step's loss still depends on its batch)."""
    return max(2, total_steps // 5)


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per record: median step time with its CI over the timed steps, the kernel's bytes
    per step on each node's link, GIFT's counted bytes per step, the final loss (trailing mean of
    `loss_window` steps), and the time to fp32's loss at `TARGET_AT` of the run (same path,
    layout and rate; None where no fp32 arm ran or the arm never reached it)."""
    fp32 = {(r["path"], r["layout"], r["rate"]): r for r in records if r["arm"] == "fp32"}
    rows = []
    for r in records:
        total = len(r["losses"])
        w = loss_window(total)
        curve = _smoothed(r["losses"], w)
        timed = r["step_times"][r["warmup"]:]
        ref = fp32.get((r["path"], r["layout"], r["rate"]))
        target = reach = None
        if ref is not None:
            target = _smoothed(ref["losses"], w)[max(0, math.ceil(TARGET_AT * len(ref["losses"])) - 1)]
            hit = next((i for i, v in enumerate(curve) if v <= target), None)
            reach = None if hit is None else sum(r["step_times"][:hit + 1])
        tx = [n["tx"] / r["steps"] for n in r["link_bytes"]]
        rx = [n["rx"] / r["steps"] for n in r["link_bytes"]]
        gift = r.get("gift_bytes")
        cross = None if gift is None else gift.get("cross_wire", gift["wire"])
        rows.append({
            "path": r["path"], "layout": r["layout"], "rate": r["rate"], "arm": r["arm"],
            "step": median_ci(timed), "tx_per_step": tx, "rx_per_step": rx,
            "gift_wire_per_step": None if gift is None else gift["wire"] / r["steps"],
            "gift_baseline_per_step": None if gift is None else gift["baseline"] / r["steps"],
            "gift_cross_per_step": None if cross is None else cross / r["steps"],
            "final_loss": curve[-1], "target_loss": target, "time_to_target": reach,
        })
    return rows


def _rate_key(label: str) -> float:
    bps = parse_rate(label)
    return math.inf if bps is None else bps


def render_table(results: dict[str, Any]) -> str:
    """The Markdown table of a results dict: per path and layout, each arm's median step time
    [95% CI] at each rate (slowest link first), its ratio to fp32's at each shaped rate, the bytes
    the kernel counted on a node's link per step (mean over nodes, transmitted), the bytes per step
    and rank GIFT's counters say it handed to collectives across nodes (`cross_wire`; HSDP: the
    replica hop), the final loss, and the time to fp32's loss at 80% of the run at the slowest
    shaped link."""
    rows = summarise(results["records"])
    rates = sorted(dict.fromkeys(r["rate"] for r in rows), key=_rate_key)
    shaped = [x for x in rates if x != "none"]
    slow = shaped[0] if shaped else rates[0]
    head = ["path", "layout", "arm", *[f"step s @ {x} [95% CI]" for x in rates], *[f"vs fp32 @ {x}" for x in shaped],
            "link MB/step/node", "GIFT cross-node MB/step/rank", "loss", f"time to target @ {slow}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["path"], r["layout"], r["arm"], r["rate"]): r for r in rows}
    for path, layout, arm in dict.fromkeys((r["path"], r["layout"], r["arm"]) for r in rows):
        cells = []
        for x in rates:
            r = by.get((path, layout, arm, x))
            cells.append("" if r is None else
                         f"{r['step']['median']:.2f} [{r['step']['lo']:.2f}, {r['step']['hi']:.2f}]")
        ratios = []
        for x in shaped:
            r, ref = by.get((path, layout, arm, x)), by.get((path, layout, "fp32", x))
            ratios.append(f"{r['step']['median'] / ref['step']['median']:.2f}x" if r and ref else "")
        first = by.get((path, layout, arm, slow)) or next(by[k] for k in by if k[:3] == (path, layout, arm))
        tx = statistics.fmean(first["tx_per_step"]) / 1e6
        gift = "" if first["gift_cross_per_step"] is None else f"{first['gift_cross_per_step'] / 1e6:.2f}"
        reach = "" if first["target_loss"] is None or first["rate"] != slow else (
            "not reached" if first["time_to_target"] is None else f"{first['time_to_target']:.1f} s")
        lines.append("| " + " | ".join([path, layout, arm, *cells, *ratios, f"{tx:.2f}", gift,
                                        f"{first['final_loss']:.3f}", reach]) + " |")
    return "\n".join(lines)


# The unshaped overhead's parts, each the difference of two arms' medians (arm, the arm below it):
# the codes with error feedback, the block rotation on top, the map with its statistics on top.
OVERHEAD_PARTS = (("codec (int2 + error feedback)", "euclid-int2-norot", "fp32"),
                  ("block rotation", EUCLID, "euclid-int2-norot"),
                  ("map and statistics", RECIPE, EUCLID))


def attribute_overhead(rows: list[dict[str, Any]]) -> list[str]:
    """Per path and layout run unshaped: the recipe's median step over fp32's, and its parts
    (`OVERHEAD_PARTS`) where both arms of a part ran; differences of medians, so a part can come
    out negative within the steps' noise (each arm's CI is in the table)."""
    unshaped = {(r["path"], r["layout"], r["arm"]): r["step"]["median"] for r in rows if r["rate"] == "none"}
    lines = []
    for path, layout in dict.fromkeys((p, l) for p, l, _ in unshaped):
        fp32, recipe = unshaped.get((path, layout, "fp32")), unshaped.get((path, layout, RECIPE))
        if fp32 is None or recipe is None:
            continue
        parts = [f"{name} {unshaped[(path, layout, a)] - unshaped[(path, layout, b)]:+.2f} s"
                 for name, a, b in OVERHEAD_PARTS if (path, layout, a) in unshaped and (path, layout, b) in unshaped]
        lines.append(f"{path} {layout}, unshaped: {RECIPE} {recipe:.2f} s against fp32's {fp32:.2f} s "
                     f"({recipe / fp32 - 1:+.0%}){': ' + ', '.join(parts) if parts else ''}")
    return lines


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Per path, layout and shaped rate where the recipe and fp32 ran: the recipe's median step
    against fp32's and bf16's (and the Euclidean arm's at the same bits, where it ran), each
    against its target (`TARGET_VS_FP32`, `TARGET_VS_EUCLID`), computed from the medians; and,
    where fp32 also ran unshaped, the floor: fp32's unshaped step over its shaped one, what an
    arm that sent nothing and cost nothing would reach on this machine."""
    med = {(r["path"], r["layout"], r["rate"], r["arm"]): r["step"]["median"] for r in rows}
    lines = []
    for (path, layout, rate), (name, euclid) in itertools.product(
            dict.fromkeys((r["path"], r["layout"], r["rate"]) for r in rows), RECIPE_PAIRS):
        if rate == "none" or (path, layout, rate, name) not in med or (path, layout, rate, "fp32") not in med:
            continue
        recipe, fp32 = med[(path, layout, rate, name)], med[(path, layout, rate, "fp32")]
        vs = recipe / fp32
        parts = [f"{vs:.2f}x fp32's ({'meets' if vs <= TARGET_VS_FP32 else 'misses'} the {TARGET_VS_FP32:.1f}x target"
                 + (f"; fp32 unshaped: {med[(path, layout, 'none', 'fp32')] / fp32:.2f}x)"
                    if (path, layout, "none", "fp32") in med else ")")]
        if (path, layout, rate, "bf16") in med:
            b = recipe / med[(path, layout, rate, "bf16")]
            parts.append(f"{b:.2f}x bf16's ({'faster' if b < 1 else 'not faster'})")
        if (path, layout, rate, euclid) in med:
            e = recipe / med[(path, layout, rate, euclid)] - 1
            parts.append(f"{e:+.0%} against {euclid} ({'within' if abs(e) <= TARGET_VS_EUCLID else 'outside'} "
                         f"{TARGET_VS_EUCLID:.0%})")
        lines.append(f"{path} {layout} @ {rate}: {name} {recipe:.2f} s, " + ", ".join(parts))
    return lines


def block(_: dict | None = None, paths: Sequence[Path] = README_RESULTS) -> str:
    """The README's `cluster` block: per results file (one command each), where it comes from,
    the measured table and the unshaped overhead's parts."""
    parts = []
    for path in paths:
        d = json.loads(path.read_text())
        rows = summarise(d["records"])
        ci = rows[0]["step"]
        overhead = verdicts(rows) + attribute_overhead(rows)
        words = shlex.split(d["command"])
        for flag in ("--note", "--out"):  # the note is quoted beside the command, the file is linked
            if flag in words:
                i = words.index(flag)
                del words[i:i + 2]
        rel = path.relative_to(ROOT).as_posix()
        parts += [
            f"Measured on an emulated cluster (`{shlex.join(words)}` -> [{rel}]({rel}); {d['note']}): "
            f"{d['model']['params'] / 1e6:.2f}M-parameter Llama ({d['model']['embedding_share']:.1%} in embedding and "
            f"head), Muon + AdamW, {d['steps']} timed steps after {d['warmup']} of warm-up; step time is the median "
            f"over the timed steps with its {ci['method']} 95% CI (n = {ci['n']}: ranks {ci['rank_lo']} and "
            f"{ci['rank_hi']}, {ci['coverage']:.1%} coverage); link bytes are the kernel's "
            f"counters on each node's interface; the target loss is fp32's at 80% of the run; "
            f"{d['model']['local_batch']} x {d['model']['seq_len']} tokens per rank and step.", "",
            render_table(d), *(["", *("- " + line for line in overhead)] if overhead else []), ""]
    return "\n".join(parts).rstrip("\n")


# ---- the cluster ----------------------------------------------------------------------------

def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True)
    if check and out.returncode:
        raise ClusterError(f"`{shlex.join(args)}` failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def check_privilege() -> None:
    """Raise `ClusterError` unless this process can create network namespaces (root, `ip`, `tc`)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2's {' and '.join(missing)} (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise ClusterError("creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); "
                           "run `sudo python -m bench.cluster.emulated ...`")


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list`)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale(names: Sequence[str]) -> list[str]:
    """The namespaces of `names` that a run of this bench made and whose run is gone (its pid,
    in the name after `PREFIX`, is not a live process)."""
    out = []
    for name in names:
        m = re.fullmatch(rf"{re.escape(PREFIX)}(\d+)-.+", name)
        if m and not _pid_alive(int(m.group(1))):
            out.append(name)
    return out


def _delete(name: str) -> None:
    """Remove namespace `name`, first ending what runs in it (only this bench's launches can)."""
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _run(["ip", "netns", "del", name], check=False)


def cleanup_stale() -> list[str]:
    """Remove the namespaces killed runs of this bench left behind; returns their names."""
    gone = stale(namespaces())
    for name in gone:
        _delete(name)
    return gone


class Cluster:
    """`nodes` namespaces joined through a bridge in a namespace of its own; a context manager
    that removes every namespace it made when it ends (also on an exception)."""

    def __init__(self, nodes: int, delay_ms: float = 0.0) -> None:
        self.nodes, self.delay_ms = nodes, delay_ms
        tag = f"{PREFIX}{os.getpid()}-"
        self.bridge_ns = tag + "br"
        self.node_ns = [f"{tag}n{k}" for k in range(nodes)]
        self.made: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Cluster:
        try:
            for ns in (self.bridge_ns, *self.node_ns):
                out = _run(["ip", "netns", "add", ns], check=False)
                if out.returncode:
                    raise ClusterError(f"cannot create network namespace {ns}: {out.stderr.strip()} "
                                       "(needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN)")
                self.made.append(ns)
            br = ["ip", "-n", self.bridge_ns]
            _run([*br, "link", "add", BRIDGE, "type", "bridge"])
            _run([*br, "link", "set", BRIDGE, "up"])
            for k, ns in enumerate(self.node_ns):
                _run([*br, "link", "add", f"v{k}", "type", "veth", "peer", "name", IFACE, "netns", ns])
                _run([*br, "link", "set", f"v{k}", "master", BRIDGE, "up"])
                node = ["ip", "-n", ns]
                _run([*node, "addr", "add", f"{self.address(k)}/24", "dev", IFACE])
                _run([*node, "link", "set", IFACE, "up"])
                _run([*node, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End this cluster's launches (their process groups) and remove its namespaces."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()
        for ns in reversed(self.made):
            _delete(ns)
        self.made.clear()

    def shape(self, bps: float | None) -> None:
        """Each node's link at `bps` in both directions (its interface's egress: the uplink; the
        bridge port's egress: the downlink), behind a netem delay when `delay_ms`; None: unshaped."""
        ports = [(["tc", "-n", ns], IFACE) for ns in self.node_ns] + \
                [(["tc", "-n", self.bridge_ns], f"v{k}") for k in range(self.nodes)]
        for tc, dev in ports:
            _run([*tc, "qdisc", "del", "dev", dev, "root"], check=False)  # none yet is fine
            if bps is None and not self.delay_ms:
                continue
            rate = ["rate", f"{int(bps)}bit", *TBF] if bps is not None else None
            if self.delay_ms:
                _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"])
                if rate:
                    _run([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", *rate])
            else:
                _run([*tc, "qdisc", "add", "dev", dev, "root", "tbf", *rate])

    def qdisc_stats(self) -> list[str]:
        """`tc -s qdisc` of each node's interface (what the shaper sent and dropped)."""
        return [_run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", IFACE]).stdout for ns in self.node_ns]

    def launch(self, g: int, worker_args: Sequence[str], log_dir: Path, timeout: float, nice: int = 0) -> None:
        """One `torchrun` per node running the worker with `worker_args`; waits for all, raises
        `ClusterError` with the tail of the failing node's log when one fails or the time is up."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": IFACE,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        logs = []
        for k, ns in enumerate(self.node_ns):
            cmd = ["ip", "netns", "exec", ns, "nice", "-n", str(nice), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(self.nodes), "--nproc-per-node", str(g), "--node-rank", str(k),
                   "--master-addr", self.address(0), "--master-port", str(MASTER_PORT),
                   "-m", "bench.cluster.emulated_worker", *worker_args]
            log = log_dir / f"node{k}.log"
            logs.append(log)
            with open(log, "wb") as f:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in self.procs):
                failed = [k for k, p in enumerate(self.procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    k = failed[0] if failed else 0
                    why = f"node {k} exited with {self.procs[k].returncode}" if failed else f"timed out after {timeout:.0f} s"
                    tail = logs[k].read_text(errors="replace").splitlines()[-25:]
                    raise ClusterError(f"launch {shlex.join(worker_args)}: {why}; its log ends:\n" + "\n".join(tail))
                time.sleep(0.5)
            failed = [k for k, p in enumerate(self.procs) if p.returncode]
            if failed:
                tail = logs[failed[0]].read_text(errors="replace").splitlines()[-25:]
                raise ClusterError(f"launch {shlex.join(worker_args)}: node {failed[0]} exited with "
                                   f"{self.procs[failed[0]].returncode}; its log ends:\n" + "\n".join(tail))
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            self.procs.clear()


@contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise SystemExit, as SIGINT raises KeyboardInterrupt, so the
    clusters' `finally` removes their namespaces on every way a run is stopped."""
    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---- the run ------------------------------------------------------------------------------------

def run_layout(cluster: Cluster, layout: str, g: int, rates: Sequence[float | None], arms: dict[str, list[str]],
               steps: int, warmup: int, timeout: float, nice: int, log: Any, fuse: bool = True,
               batch: int = LOCAL_BATCH) -> list[dict[str, Any]]:
    """Every (rate, path) of one layout on `cluster`: the worker's records, tagged; `batch`
    sequences per rank per step."""
    records = []
    with tempfile.TemporaryDirectory(prefix="giftemu-") as tmp:
        for bps in rates:
            cluster.shape(bps)
            for path, names in arms.items():
                if not names:
                    continue
                out = Path(tmp) / f"{path}-{rate_label(bps)}.jsonl"
                log(f"{layout} @ {rate_label(bps)}: {path} arms {', '.join(names)}")
                start = time.monotonic()
                cluster.launch(g, ["--path", path, "--arms", ",".join(names), "--steps", str(steps),
                                   "--warmup", str(warmup), "--batch", str(batch), "--iface", IFACE, "--out", str(out),
                                   *([] if fuse else ["--eager"])],
                               Path(tmp), timeout, nice)
                for line in out.read_text().splitlines():
                    r = json.loads(line)
                    r.update(layout=layout, nodes=cluster.nodes, ranks_per_node=g, rate=rate_label(bps), rate_bps=bps)
                    records.append(r)
                    row = summarise([r])[0]
                    log(f"  {r['arm']}: median step {row['step']['median']:.3f} s, link "
                        f"{statistics.fmean(row['tx_per_step']) / 1e6:.2f} MB/step/node, loss {row['final_loss']:.3f}")
                log(f"  ({time.monotonic() - start:.0f} s)")
    return records


def calibrate(cluster: Cluster, layout: str, g: int, steps: int, warmup: int, timeout: float, nice: int,
              log: Any, batch: int = LOCAL_BATCH) -> dict[str, Any]:
    """fp32 on DDP, unshaped: its median step (the compute, the link being fast) and the bytes a
    node sends per step; the rate at which sending them takes as long as that step, and 4x slower."""
    r = run_layout(cluster, layout, g, [None], {"ddp": ["fp32"]}, steps, warmup, timeout, nice, log, batch=batch)[0]
    row = summarise([r])[0]
    sent = max(row["tx_per_step"])
    balanced = sent * 8 / row["step"]["median"]
    out = {"layout": layout, "unshaped_step_s": row["step"]["median"], "tx_bytes_per_step": sent,
           "balanced_bps": balanced, "rates": [rate_label(_round_rate(balanced)), rate_label(_round_rate(balanced / 4))]}
    log(f"calibration ({layout}): fp32 step {row['step']['median']:.3f} s unshaped, {sent / 1e6:.2f} MB/step sent per "
        f"node: its communication equals its compute at {balanced / 1e6:.0f} Mbit/s; proposed rates "
        f"{', '.join(out['rates'])}, none")
    return out


def _round_rate(bps: float) -> float:
    """Two significant digits in Mbit/s (tc takes any rate; round numbers read better)."""
    mbit = bps / 1e6
    digits = max(0, 1 - int(math.floor(math.log10(mbit))))
    return round(mbit, digits) * 1e6


def host_info() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "load_average": os.getloadavg()}


def plot(results: dict[str, Any], path: Path) -> None:
    """Median step time against link rate, one panel per (path, layout), one line per arm;
    unshaped is drawn right of the fastest shaped rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarise(results["records"])
    groups = list(dict.fromkeys((r["path"], r["layout"]) for r in rows))
    rates = sorted(dict.fromkeys(r["rate"] for r in rows), key=_rate_key)
    xs = {x: i for i, x in enumerate(rates)}
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (p, layout) in zip(axes[0], groups):
        for arm in dict.fromkeys(r["arm"] for r in rows if (r["path"], r["layout"]) == (p, layout)):
            pts = sorted(((xs[r["rate"]], r["step"]) for r in rows if (r["path"], r["layout"], r["arm"]) == (p, layout, arm)),
                         key=lambda t: t[0])
            ax.errorbar([x for x, _ in pts], [s["median"] for _, s in pts],
                        yerr=[[s["median"] - s["lo"] for _, s in pts], [s["hi"] - s["median"] for _, s in pts]],
                        marker="o", capsize=3, label=arm)
        ax.set_xticks(range(len(rates)), [x if x != "none" else "unshaped" for x in rates])
        ax.set_xlabel("link rate per node")
        ax.set_ylabel("median step time (s, 95% CI)")
        ax.set_title(f"{p}, {layout} (nodes x ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.emulated", description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=None, help="comma-separated arm names (bench.cluster.emulated_worker.ARMS); "
                                                "default: " + ",".join(DEFAULT_ARMS) + " and the bf16-parameter arms")
    p.add_argument("--paths", default="ddp,fsdp2,hsdp", help="comma-separated: ddp, fsdp2, hsdp")
    p.add_argument("--layouts", default="2x2,4x1", help="comma-separated NODESxRANKS")
    p.add_argument("--rates", default="auto,none",
                   help="comma-separated link rates per node and direction (25mbit, 1gbit, none = unshaped, auto = "
                        "the calibrated rate where fp32's communication equals its compute, and 4x slower)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added on each link (netem)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm before them")
    p.add_argument("--batch", type=int, default=LOCAL_BATCH,
                   help=f"sequences per rank per step (default {LOCAL_BATCH}: {LOCAL_BATCH} x {SEQ_LEN} tokens)")
    p.add_argument("--calibrate", action="store_true", help="only measure and propose the rates, then stop")
    p.add_argument("--nice", type=int, default=0, help="niceness of the ranks (negative: ahead of other jobs)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one launch (a path's arms) may take")
    p.add_argument("--eager", dest="fuse", action="store_false",
                   help="GIFT's codec eager (apply's fuse=False); the default is what apply gives a user: fused "
                        "through torch.compile, compiled in the warm-up steps")
    p.add_argument("--note", default="", help="recorded with the results (e.g. what else ran on the machine)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--render", action="store_true",
                   help="run nothing: recompute the summary, plot and table of the results in --out (and --note, if given)")
    a = p.parse_args(argv)
    if a.render:
        results = json.loads(a.out.read_text())
        results["summary"] = summarise(results["records"])
        results["note"] = a.note or results["note"]
        _write(results, a.out)
        return 0
    try:
        paths = [x.strip() for x in a.paths.split(",")]
        arms = parse_arms(a.arms, paths)
        layouts = [(x.strip(), *parse_layout(x)) for x in a.layouts.split(",")]
        rate_texts = [x.strip() for x in a.rates.split(",")]
        fixed = [parse_rate(x) for x in rate_texts if x != "auto"]
        if a.steps < 1 or a.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
    except ValueError as e:
        print(f"bench.cluster.emulated: {e}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)

    command = shlex.join(["python", "-m", "bench.cluster.emulated", *(sys.argv[1:] if argv is None else argv)])
    try:
        check_privilege()
        with _signals_end_the_run():
            removed = cleanup_stale()
            if removed:
                log(f"removed namespaces of killed runs: {', '.join(removed)}")
            host = host_info()
            records: list[dict[str, Any]] = []
            calibrations = []
            started = time.time()
            for label, nodes, g in layouts:
                with Cluster(nodes, a.delay_ms) as cluster:
                    rates: list[float | None] = []
                    if a.calibrate or "auto" in rate_texts:
                        c = calibrate(cluster, label, g, a.steps, a.warmup, a.timeout, a.nice, log, a.batch)
                        calibrations.append(c)
                        if a.calibrate:
                            continue
                        rates += [parse_rate(x) for x in c["rates"]]
                    rates += [x for x in fixed if x not in rates]
                    records += run_layout(cluster, label, g, rates, arms, a.steps, a.warmup, a.timeout, a.nice, log, a.fuse,
                                          a.batch)
    except ClusterError as e:
        print(f"bench.cluster.emulated: {e}", file=sys.stderr)
        return 1
    if a.calibrate:
        print(json.dumps(calibrations, indent=1))
        return 0
    params, share = embedding_share()
    results = {
        "command": command, "note": a.note or "a run", "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "seconds": time.time() - started, "host": {**host, "load_average_end": os.getloadavg()},
        "model": {"config": {k: getattr(MODEL, k) for k in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden")},
                  "params": params, "embedding_share": share, "local_batch": a.batch, "seq_len": SEQ_LEN,
                  "optimizer": "muon (hidden matrices) + adamw (embedding, norms, head)"},
        "steps": a.steps, "warmup": a.warmup, "delay_ms": a.delay_ms, "gift_fuse": a.fuse,
        "link": {"shaper": "tbf " + " ".join(TBF) + " on each node's interface and its bridge port",
                 "rates": sorted(dict.fromkeys(r["rate"] for r in records), key=_rate_key)},
        "calibration": calibrations, "records": records, "summary": summarise(records),
    }
    _write(results, a.out)
    return 0


def _write(results: dict[str, Any], out: Path) -> None:
    """The results JSON at `out`, its plot beside it (`.png`), and the table on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(render_table(results))
    print(f"-> {out}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
