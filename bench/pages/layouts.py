"""The "layouts" block of docs/benchmarks.md, from `bench/results/cluster/layouts.json`
(`bench.cluster.layouts`): per layout and trainer, whether GIFT runs or is refused (with the reason),
each hop's bytes counted at the collective against the accounted and the fp32 bytes, and the
losses against GIFT off."""

from __future__ import annotations

import json

from bench.lib.formatting import table
from bench.cluster.layout_table import LAYOUTS as PLANNED, SUITE, order, planned
from bench.lib.paths import RESULTS

LAYOUTS = RESULTS / "cluster" / "layouts.json"


def _hops(arm: dict) -> str:
    """Each hop's bytes per step at the last step, `counted of fp32`, per pipeline rank under PP."""
    def one(hops: dict) -> str:
        return "; ".join(f"{hop} {h['counted'][-1]:.0f} of {h['fp32'][-1]:.0f}" for hop, h in hops.items()
                         if h["fp32"][-1] or h["counted"][-1])  # DDP: the one-rank shard hop sends nothing
    if "hops_by_pipeline_rank" in arm:
        return "; ".join(f"pp{k}: {one(h)}" for k, h in arm["hops_by_pipeline_rank"].items())
    return one(arm["hops"])


def layouts(_: dict) -> str:
    """The block: the table (every planned layout x trainer, one not measured yet as "not run"),
    then each row's commands (or its refusal or failure)."""
    d = json.loads(LAYOUTS.read_text())
    rows, notes = [], []
    for key in sorted({*planned(), *d["rows"]}, key=order):
        if key not in d["rows"]:
            layout, trainer = key.split("/")
            rows.append([PLANNED[layout][0], str(PLANNED[layout][1]), trainer, "not run", *[""] * 6, _suite(key)])
            continue
        r = d["rows"][key]
        if r["status"] == "refused":
            rows.append([r["layout"], str(r["nproc"]), r["trainer"], "refused (below)", "", "", "", "", f"{r['wall_s']:.0f}", "",
                         _suite(key)])
            notes.append(f"* {r['layout']}, {r['trainer']}: refused, `{r['command']}`: {r['reason']}")
            continue
        if r["status"] == "failed":
            rows.append([r["layout"], str(r["nproc"]), r["trainer"], f"{r['failed_arm']} run failed (below)",
                         "", "", "", "", f"{r['wall_s']:.0f}", "", _suite(key)])
            off = (f"GIFT off fails too (`{r['off_command']}`): {r['off_reason']}" if r["off_fails"]
                   else f"GIFT off runs (`{r['off_command']}`)")
            notes.append(f"* {r['layout']}, {r['trainer']}: the {r['failed_arm']} run failed, `{r['command']}`: "
                         f"{r['reason']}" + ("" if r["failed_arm"] == "off" else f"; {off}"))
            continue
        arms = r["arms"]
        low = arms["low_bit"]
        refused = any(a["refusal_in_log"] for a in arms.values())
        warned = sorted({w for a in arms.values() for w in a.get("gift_warning_lines", [])})
        state = "runs" if not refused else "runs, a refusal in a log"
        if warned:
            state += f"; {len(warned)} distinct GIFT warnings (below)"
            notes.append(f"* {r['layout']}, {r['trainer']}: GIFT warnings: " + "; ".join(f"`{w[:160]}`" for w in warned))
        elif any(a["gift_warnings"] for a in arms.values()):
            state += "; GIFT warnings in a log"
        if low["replicas_bit_identical_logged"]:
            state += "; replicas bit-identical after the refresh"
        rows.append([r["layout"], str(r["nproc"]), r["trainer"], state,
                     _hops(low), "yes" if r["counted_equals_accounted_every_hop"] else "no",
                     f"{r['low_bit_max_abs_loss_diff']:.2e}",
                     f"{'yes' if r['fp32_losses_equal_off'] else 'no'} (max diff {r['fp32_max_abs_loss_diff']:.1e})",
                     " / ".join(f"{arms[a]['wall_s']:.0f}" for a in ("low_bit", "fp32", "off")),
                     _kill_resume(r.get("kill_resume")), _suite(key)])
        losses = "; ".join(f"{arm} " + ", ".join(f"{v:.5f}" for v in arms[arm]["losses"].values())
                           for arm in ("low_bit", "off"))
        notes.append(f"* {r['layout']}, {r['trainer']}: losses by step: {losses}; nvfp4 `{low['command']}`; GIFT off "
                     f"`{arms['off']['command']}`"
                     + (f"; {low['rewrite']}" if low["rewrite"] else ""))
    first = next(iter(d["rows"].values()))
    commits = ", ".join(dict.fromkeys(r["commit"] for r in d["rows"].values()))
    dates = ", ".join(dict.fromkeys(r["date"] for r in d["rows"].values()))
    head = (f"`{d['command']}` ({dates}, rows at commits {commits}, each row's in the results file; {first['machine'].split(' (load')[0]}, the load at each row's start in the "
            f"results file); {first['steps']} steps of the debug Llama (the MoE rows: the debug MoE), a refresh after step 2; three runs per row with the same seed, init and data: "
            "GIFT at nvfp4 (both hops under HSDP), GIFT at fp32, GIFT off. Bytes per step at the last step: handed to "
            "GIFT's collectives as counted at run time, of what fp32 hands over (the replica hop: of the buffer an fp32 "
            "all-reduce is given; rank 0; under PP the first rank of "
            "each pipeline rank); counted = accounted: equal to the plans' accounting at every step, on every hop, "
            "at nvfp4 and fp32:")
    both = [layout for layout in dict.fromkeys(r["layout"] for r in d["rows"].values())
            if [r["status"] for r in d["rows"].values() if r["layout"] == layout] == ["runs", "runs"]]
    for layout in both:
        fsdp2, graph = (r["arms"] for r in d["rows"].values() if r["layout"] == layout)
        same = all(fsdp2[arm]["losses"] == graph[arm]["losses"] for arm in fsdp2)
        notes.append(f"* {layout}: the two trainers' losses are "
                     + ("equal in every arm (nvfp4, fp32, off)" if same else "not equal in every arm"))
    return "\n".join([head, "", table(["layout", "ranks", "trainer", "GIFT", "bytes per step (nvfp4)", "counted = accounted",
                                       "nvfp4 max abs loss diff vs off", "fp32 losses == off",
                                       "wall s (nvfp4 / fp32 / off)", "kill rank 1 after step 4, relaunch",
                                       "suite tests"], rows),
                     "", *notes, *_kill_resume_notes(d)])


def _suite(key: str) -> str:
    """The suite-tests cell: the test functions of the row (`bench.cluster.layout_table.SUITE`), by file."""
    tests = SUITE.get(key)
    if not tests:
        return "this bench only"
    return "; ".join(f"`{t.split('/')[-1]}`" for t in tests)


def _kill_resume(k: dict | None) -> str:
    """The kill-and-resume cell: bit-identical or not, from what `bench.cluster.layouts --kill-resume` found."""
    if k is None:
        return "not run"
    verdict = "bit-identical" if k["bit_identical"] else f"differs ({k['differing_tensors']} tensors)"
    off = k.get("gift_off")
    if off is not None:  # the same fault with GIFT off: whose difference it is
        verdict += ("; GIFT off is bit-identical: GIFT's" if off["bit_identical"] else
                    f"; GIFT off differs too ({off['differing_tensors']} of {off['trained_tensors_compared']} tensors, "
                    f"loss diff {off['max_abs_loss_diff']:.1e}): torchtitan's resume on this layout")
    return (f"{verdict}: steps {min(k['replayed_steps'])}-{max(k['replayed_steps'])} replayed, loss diff "
            f"{k['max_abs_loss_diff']:.1e}, {k['trained_tensors_compared']} tensors compared")


def _kill_resume_notes(d: dict) -> list[str]:
    """How the kill-and-resume cells were made, when any was."""
    made = [r["kill_resume"] for r in d["rows"].values() if "kill_resume" in r]
    if not made:
        return []
    commits = ", ".join(dict.fromkeys(k["commit"] for k in made))
    return ["", f"Kill-and-resume (`{d['kill_resume_command']}`, commits {commits}): 6 steps at nvfp4 with the "
                "low-rank K-FAC map, error feedback and a checkpoint every 3 steps, run uninterrupted; the same "
                "command with rank 1 SIGKILLed once step 4 is logged, then relaunched on its folder: it resumes from "
                "step 3's checkpoint; compared are the logged losses of steps 4-6 and every trained tensor of the "
                "final checkpoint (parameters, optimizer, GIFT state). e.g. "
                f"`{made[0]['command']}`."]
