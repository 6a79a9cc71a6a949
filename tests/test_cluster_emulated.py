"""The emulated cluster end to end (slower tier): `python -m bench.cluster.emulated` on 2 nodes x
2 ranks, 2 timed steps of fp32 and the `muon-int2-leaky-ef` recipe on DDP over a shaped link. Its
namespaces are gone afterwards, the kernel counted bytes on every node's link, GIFT counted what
it handed to its collectives, and the JSON has its fields; a run stopped by SIGTERM while its
ranks train removes its namespaces too. Without root the bench must refuse with its reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.cluster import emulated

ROOT = Path(__file__).resolve().parent.parent


def _bench(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.cluster.emulated", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ours(pid: int) -> list[str]:
    return [n for n in emulated.namespaces() if n.startswith(f"{emulated.PREFIX}{pid}-")]


def test_two_nodes_two_steps_counts_bytes_and_leaves_no_namespace(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    proc = _bench(["--paths", "ddp", "--layouts", "2x2", "--rates", "200mbit", "--arms", "fp32,muon-int2-leaky-ef",
                   "--steps", "2", "--warmup", "1", "--timeout", "600", "--out", str(out)])
    stdout, stderr = proc.communicate(timeout=900)
    if os.geteuid() != 0:  # the refusal: one line naming the reason, a failing exit code
        assert proc.returncode == 1 and "root" in stderr and len(stderr.strip().splitlines()) == 1
        return
    assert proc.returncode == 0, stderr[-3000:]
    assert _ours(proc.pid) == []
    d = json.loads(out.read_text())
    for key in ("command", "host", "model", "steps", "warmup", "link", "records", "summary"):
        assert key in d
    assert d["model"]["embedding_share"] <= 0.15 and d["link"]["rates"] == ["200mbit"]
    assert {r["arm"] for r in d["records"]} == {"fp32", "muon-int2-leaky-ef"}
    for r in d["records"]:
        assert (r["layout"], r["rate"], len(r["step_times"]), len(r["losses"])) == ("2x2", "200mbit", 3, 3)
        assert len(r["link_bytes"]) == 2 and all(n["tx"] > 0 and n["rx"] > 0 for n in r["link_bytes"])
    gift = next(r for r in d["records"] if r["arm"] == "muon-int2-leaky-ef")
    assert 0 < gift["gift_bytes"]["cross_wire"] < gift["gift_bytes"]["baseline"] / 4  # int2 codes across the nodes
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| ddp | 2x2 | muon-int2-leaky-ef |" in stdout


def test_sigterm_during_a_run_removes_its_namespaces(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        return  # the refusal is the test above's
    proc = _bench(["--paths", "ddp", "--layouts", "2x1", "--rates", "none", "--arms", "fp32", "--steps", "50",
                   "--warmup", "1", "--out", str(tmp_path / "x.json")])
    deadline = time.monotonic() + 120
    while not _ours(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert _ours(proc.pid), "the run made no namespace"
    time.sleep(5)  # the ranks are starting or training
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert _ours(proc.pid) == []
