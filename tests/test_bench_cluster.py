"""The emulated cluster's pure pieces (`bench.cluster.emulated`): arm, layout and rate parsing,
the median's order-statistic CI against a brute-force binomial, the table and the time to the
target loss from a small recorded run, and the removal of a killed run's namespace (as root; the
refusal with its reason otherwise). The cluster itself runs in the slower tier
(tests/test_cluster_emulated.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from bench.cluster import emulated
from bench.cluster.emulated import (ClusterError, median_ci, parse_arms, parse_layout, parse_rate, rate_label,
                                    render_table, summarise)


def test_arms_layouts_and_rates_parse_and_bad_ones_name_the_problem() -> None:
    assert parse_arms("fp32,powersgd-4,muon-int2-leaky-ef-flat", ["ddp", "fsdp2"]) == {
        "ddp": ["fp32", "powersgd-4", "muon-int2-leaky-ef-flat"], "fsdp2": ["fp32", "muon-int2-leaky-ef-flat"]}
    assert parse_arms("fp32-bf16p", ["ddp", "hsdp"]) == {"ddp": [], "hsdp": ["fp32-bf16p"]}
    default = parse_arms(None, ["ddp", "fsdp2"])
    assert "powersgd-4" in default["ddp"] and "powersgd-4" not in default["fsdp2"]
    with pytest.raises(ValueError, match="known arms"):
        parse_arms("fp32,gift-int9", ["ddp"])
    with pytest.raises(ValueError, match="runs on ddp"):
        parse_arms("powersgd-8", ["fsdp2", "hsdp"])
    with pytest.raises(ValueError, match="path 'zero'"):
        parse_arms("fp32", ["zero"])
    assert parse_layout("2x2") == (2, 2) and parse_layout("4x1") == (4, 1)
    for bad in ("1x4", "2x0", "2*2"):
        with pytest.raises(ValueError, match="NODESxRANKS"):
            parse_layout(bad)
    assert parse_rate("25mbit") == 25e6 and parse_rate("1gbit") == 1e9 and parse_rate("none") is None
    assert rate_label(parse_rate("100mbit")) == "100mbit" and rate_label(None) == "none"
    for bad in ("25", "fast", "0mbit"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


def _coverage(n: int, j: int) -> float:
    """P(X_(j) <= median <= X_(n+1-j)) for a continuous distribution, by summing binomial terms."""
    return sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2 ** n


@pytest.mark.parametrize("n", [5, 6, 10, 20, 47])
def test_median_ci_takes_the_narrowest_order_statistics_with_95_percent_coverage(n: int) -> None:
    xs = [float((7 * i) % n) for i in range(n)]  # a permutation of 0..n-1: rank k is the value k - 1
    ci = median_ci(xs)
    j = max((k for k in range(1, n // 2 + 1) if _coverage(n, k) >= 0.95), default=1)
    assert (ci["lo"], ci["hi"], ci["n"]) == (j - 1, n - j, n)
    assert ci["coverage"] == pytest.approx(_coverage(n, j)) and ci["median"] == (n - 1) / 2
    if n == 5:  # too few for 95%: the range, and what it covers
        assert (ci["lo"], ci["hi"]) == (0, 4) and ci["coverage"] == pytest.approx(1 - 2 / 32)
    else:
        assert ci["coverage"] >= 0.95 and _coverage(n, j + 1) < 0.95  # the next pair in would fall short


def _record(arm: str, rate: str, times: list[float], losses: list[float], gift: int | None = None) -> dict:
    r = {"arm": arm, "path": "ddp", "layout": "2x2", "rate": rate, "steps": len(times) - 1, "warmup": 1,
         "step_times": times, "losses": losses,
         "link_bytes": [{"rx": 4_000_000, "tx": 3_000_000}, {"rx": 4_000_000, "tx": 5_000_000}]}
    if gift is not None:
        r["gift_bytes"] = {"wire": 3 * gift, "baseline": 4 * gift, "node_wire": 2 * gift, "cross_wire": gift}
    return r


def test_table_and_time_to_target_from_a_recorded_run() -> None:
    fp32_loss = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0]  # 10 steps: window 2, target = steps 7-8's 2.25
    records = [
        _record("fp32", "100mbit", [9.0] + [2.0] * 9, fp32_loss),
        _record("fp32", "none", [9.0] + [1.0] * 9, fp32_loss),
        _record("gift", "100mbit", [9.0] + [1.0] * 9, [8, 7, 6, 5, 4, 3, 2.6, 2.5, 2.4, 2.3], gift=2_000_000),
        _record("pgd", "100mbit", [9.0] + [0.5] * 9, [8, 7, 6, 5, 4, 3, 2, 1.5, 1.4, 1.3]),
    ]
    rows = {(r["arm"], r["rate"]): r for r in summarise(records)}
    assert rows[("fp32", "100mbit")]["target_loss"] == 2.25
    assert rows[("fp32", "100mbit")]["time_to_target"] == pytest.approx(9.0 + 2.0 * 7)  # reached at step 8
    assert rows[("gift", "100mbit")]["time_to_target"] is None  # its curve ends at 2.35 > 2.25
    assert rows[("pgd", "100mbit")]["time_to_target"] == pytest.approx(9.0 + 0.5 * 7)  # 1.75 at step 8
    assert rows[("gift", "100mbit")]["gift_cross_per_step"] == pytest.approx(2_000_000 / 9)
    assert rows[("fp32", "none")]["tx_per_step"] == pytest.approx([3e6 / 9, 5e6 / 9])
    table = render_table({"records": records}).splitlines()
    assert table[0].startswith("| path | layout | arm | step s @ 100mbit [95% CI] | step s @ none [95% CI] | vs fp32 @ 100mbit")
    by_arm = {line.split(" | ")[2]: line for line in table[2:]}
    assert "| 2.00 [2.00, 2.00] | 1.00 [1.00, 1.00] | 1.00x |" in by_arm["fp32"]
    assert "| 1.00 [1.00, 1.00] |  | 0.50x | 0.44 | 0.22 | 2.350 | not reached |" in by_arm["gift"]
    assert by_arm["pgd"].endswith("| 0.25x | 0.44 |  | 1.350 | 12.5 s |")


def test_every_shaped_rate_gets_its_ratio_and_the_block_renders_each_results_file(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    loss = [3.0, 2.0, 1.0, 0.5]
    records = [_record("fp32", "25mbit", [9.0, 8.0, 8.0, 8.0], loss), _record("gift", "25mbit", [9.0, 2.0, 2.0, 2.0], loss),
               _record("fp32", "100mbit", [9.0, 4.0, 4.0, 4.0], loss), _record("gift", "100mbit", [9.0, 3.0, 3.0, 3.0], loss)]
    table = render_table({"records": records}).splitlines()
    assert table[0].split(" | ")[4:8] == ["step s @ 100mbit [95% CI]", "vs fp32 @ 25mbit", "vs fp32 @ 100mbit",
                                           "link MB/step/node"]
    assert "| 0.25x | 0.75x |" in next(line for line in table if " gift " in line)
    assert table[0].endswith("| time to target @ 25mbit |")  # the slowest shaped link's
    model = {"params": 2e6, "embedding_share": 0.1, "local_batch": 4, "seq_len": 8}
    paths = []
    for name, path in (("ddp", "ddp"), ("hsdp", "hsdp")):
        out = tmp_path / f"{name}.json"
        recs = [{**r, "path": path} for r in records]
        out.write_text(json.dumps({"command": f"python -m bench.cluster.emulated --paths {path} --note 'busy box' "
                                              f"--out /elsewhere/{name}.json",
                                   "note": f"{name} note", "model": model, "steps": 3, "warmup": 1, "records": recs}))
        paths.append(out)
    monkeypatch.setattr(emulated, "ROOT", tmp_path)
    text = emulated.block(None, paths)
    assert text.count("Measured on an emulated cluster") == 2
    assert "`python -m bench.cluster.emulated --paths ddp` -> [ddp.json](ddp.json); ddp note" in text
    assert "| hsdp | 2x2 | gift |" in text and "| ddp | 2x2 | gift |" in text
    assert "busy box" not in text and "elsewhere" not in text


def test_the_unshaped_overhead_splits_into_the_arms_differences() -> None:
    loss = [3.0] * 4
    arms = {"fp32": 1.0, "euclid-int2-norot": 1.5, "euclid-int2": 1.75, "muon-int2-leaky-ef": 2.5}
    records = [_record(arm, "none", [9.0] + [t] * 3, loss) for arm, t in arms.items()]
    records.append(_record("fp32", "50mbit", [9.0] + [4.0] * 3, loss))  # shaped runs are not attributed
    (line,) = emulated.attribute_overhead(summarise(records))
    assert line == ("ddp 2x2, unshaped: muon-int2-leaky-ef 2.50 s against fp32's 1.00 s (+150%): codec (int2 + error "
                    "feedback) +0.50 s, block rotation +0.25 s, map and statistics +0.75 s")
    # without the recipe's unshaped run there is nothing to attribute
    assert emulated.attribute_overhead(summarise([r for r in records if r["arm"] != "muon-int2-leaky-ef"])) == []


def test_the_recipes_step_is_read_against_fp32_bf16_and_euclidean_at_each_shaped_rate() -> None:
    loss = [3.0] * 4
    steps = {("fp32", "100mbit"): 4.0, ("bf16", "100mbit"): 3.0, ("euclid-int2", "100mbit"): 2.0,
             ("muon-int2-leaky-ef", "100mbit"): 2.1, ("fp32", "25mbit"): 10.0, ("muon-int2-leaky-ef", "25mbit"): 3.0,
             ("fp32", "none"): 1.0, ("muon-int2-leaky-ef", "none"): 2.0}
    rows = summarise([_record(arm, rate, [9.0] + [t] * 3, loss) for (arm, rate), t in steps.items()])
    assert emulated.verdicts(rows) == [
        "ddp 2x2 @ 100mbit: muon-int2-leaky-ef 2.10 s, 0.53x fp32's (meets the 0.6x target; fp32 unshaped: 0.25x), "
        "0.70x bf16's (faster), "
        "+5% against euclid-int2 (within 10%)",
        "ddp 2x2 @ 25mbit: muon-int2-leaky-ef 3.00 s, 0.30x fp32's (meets the 0.6x target; fp32 unshaped: 0.10x)"]
    slow = summarise([_record(arm, "100mbit", [9.0] + [t] * 3, loss)
                      for arm, t in (("fp32", 4.0), ("euclid-int2", 2.0), ("muon-int2-leaky-ef", 3.0))])
    assert emulated.verdicts(slow) == ["ddp 2x2 @ 100mbit: muon-int2-leaky-ef 3.00 s, 0.75x fp32's (misses the 0.6x "
                                       "target), +50% against euclid-int2 (outside 10%)"]
    # HSDP with the shard hop left to FSDP2: the recipe judged against the Euclidean arm of the same hops
    native = summarise([_record(arm, "100mbit", [9.0] + [t] * 3, loss)
                        for arm, t in (("fp32", 4.0), ("euclid-int2-nativehop", 2.0), ("muon-int2-leaky-ef-nativehop", 2.1),
                                       ("euclid-int2", 1.0))])
    assert emulated.verdicts(native) == ["ddp 2x2 @ 100mbit: muon-int2-leaky-ef-nativehop 2.10 s, 0.53x fp32's (meets "
                                         "the 0.6x target), +5% against euclid-int2-nativehop (within 10%)"]


def test_a_killed_runs_namespace_is_removed_and_a_live_runs_kept_or_the_refusal_names_root() -> None:
    try:
        emulated.check_privilege()
    except ClusterError as e:  # not root, or no iproute2: the bench refuses with the reason
        assert "root" in str(e) or "iproute2" in str(e)
        assert emulated.main(["--paths", "ddp", "--layouts", "2x1", "--rates", "none"]) == 1
        return
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process: a killed run's
    killed, live = f"{emulated.PREFIX}{dead.pid}-n0", f"{emulated.PREFIX}{os.getpid()}-test"
    made = []
    try:
        for name in (killed, live):
            out = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
            if out.returncode:  # root without CAP_SYS_ADMIN (a container): the cluster refuses by name
                with pytest.raises(ClusterError, match="cannot create network namespace"):
                    emulated.Cluster(2).__enter__()
                return
            made.append(name)
        assert killed in emulated.stale(emulated.namespaces()) and live not in emulated.stale(emulated.namespaces())
        assert emulated.cleanup_stale() == [killed]
        names = emulated.namespaces()
        assert killed not in names and live in names
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_the_readmes_measured_step_row_reads_the_ddp_run(tmp_path: Path) -> None:
    """The first screen's step-time row: fp32, the Euclidean arm and the recipe at each shaped rate of
    the DDP results file (slowest first), each low-bit arm with its ratio to fp32's."""
    from bench.pages.readme import measured_step_row

    loss = [3.0] * 4
    steps = {("fp32", "25mbit"): 8.0, ("euclid-int2", "25mbit"): 2.0, ("muon-int2-leaky-ef", "25mbit"): 3.0,
             ("fp32", "100mbit"): 4.0, ("euclid-int2", "100mbit"): 3.0, ("muon-int2-leaky-ef", "100mbit"): 3.5,
             ("fp32", "none"): 1.0}
    out = tmp_path / "emulated.json"
    out.write_text(json.dumps({"model": {"params": 5.44e6}, "steps": 3,
                               "records": [_record(arm, rate, [9.0] + [t] * 3, loss) for (arm, rate), t in steps.items()]}))
    row = measured_step_row(out)
    assert "DDP, 2 nodes x 2 ranks, 5.44M-parameter Llama, at 25mbit / 100mbit per node; median of 3 steps" in row
    assert row.endswith("| 8.00 s / 4.00 s | 2.00 s (0.25x) / 3.00 s (0.75x) | 3.00 s (0.38x) / 3.50 s (0.88x) "
                        "(`muon-int2-leaky-ef`) |")
