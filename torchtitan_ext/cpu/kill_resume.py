"""Kill a rank of a running torchtitan job, relaunch it, and compare with an uninterrupted run.

The fault a long run meets most: one worker dies (OOM killer, a node lost). torchtitan then
fails the job; relaunched on the same dump folder it resumes from its last DCP checkpoint,
GIFT state included. Same ranks, same data, same reduction order: nothing may differ from the
run that was never interrupted, so the comparison is bit for bit. Used by the suite's
kill-and-resume tests (2 and 4 ranks) and by `bench.cluster.layouts` (every layout, up to 8 ranks), which record
what this returns instead of asserting it.

torchrun's in-place restart (``--max-restarts``) cannot be used on gloo here: the restarted
workers read the killed attempt's gloo addresses from the agent's store and fail in
``connectFullMesh`` (docs/torchtitan/configuration.md), so the job is relaunched as a user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .runs import RunResult, config_command, run_config, run_env
from ..telemetry import read_jsonl

__all__ = ["KillResume", "checkpoint_tensors", "kill_and_resume", "run_killing_rank"]

# Checkpoint entries a resume restores from elsewhere or rebuilds (not trained state)
_UNTRAINED = ("dataloader", "train_state", "lr_scheduler")


@dataclass
class KillResume:
    """What a kill, relaunch and comparison found (`kill_and_resume`)."""

    killed_returncode: int
    killed_after_step: int
    """The last step logged before the SIGKILL (-1: the run ended before the kill)."""
    final_checkpoint_before_relaunch: bool
    """Whether the killed attempt had written the last step's checkpoint (it must not have)."""
    relaunched: RunResult
    loaded_checkpoint: bool
    replayed_steps: list[int]
    """Steps the relaunched job logged (from its output): those after the resumed checkpoint."""
    loss_diff: dict[int, float]
    """|relaunched - uninterrupted| logged loss by step, from the kill step to the last."""
    trained_keys: int
    """Checkpoint tensors compared (parameters, optimizer, GIFT state)."""
    has_optimizer_and_gift_state: bool
    differing: dict[str, float] = field(default_factory=dict)
    """Final-checkpoint tensors that differ from the uninterrupted run's, with their max abs diff."""
    key_sets_equal: bool = True

    @property
    def bit_identical(self) -> bool:
        """The relaunched job ended where the uninterrupted one did, bit for bit."""
        return (self.key_sets_equal and not self.differing and self.has_optimizer_and_gift_state
                and self.loaded_checkpoint and self.killed_returncode != 0
                and not self.final_checkpoint_before_relaunch)

    def summary(self) -> dict:
        """JSON-ready record (benchmarks store it)."""
        return {"killed_returncode": self.killed_returncode, "killed_after_step": self.killed_after_step,
                "loaded_checkpoint": self.loaded_checkpoint, "replayed_steps": self.replayed_steps,
                "max_abs_loss_diff": max(self.loss_diff.values(), default=None),
                "trained_tensors_compared": self.trained_keys, "differing_tensors": len(self.differing),
                "bit_identical": self.bit_identical, "relaunch_wall_s": round(self.relaunched.wall_s, 1)}


def kill_and_resume(config: str, args: Sequence[str], folder: Path, full: RunResult, full_folder: Path, *,
                    steps: int, after_step: int = 4, nproc: int = 2, rank: int = 1) -> KillResume:
    """Run ``config args`` into `folder`, SIGKILL ``rank`` once step `after_step` is logged,
    relaunch on the same folder and compare with `full` (the same command run uninterrupted into
    `full_folder`): the logged losses from `after_step` on and every trained tensor of the
    step-`steps` checkpoint. The command must checkpoint before `after_step`."""
    killed, killed_at = run_killing_rank(config, args, folder, after_step=after_step, nproc=nproc, rank=rank)
    final_written = (folder / "checkpoint" / f"step-{steps}").exists()
    relaunched = run_config(config, args, dump_folder=str(folder), nproc=nproc).check()
    logged = [int(m.group(1)) for line in relaunched.output.splitlines()
              if (m := re.search(r"step:\s+(\d+)\s+loss", line))]
    a, b = full.losses(), relaunched.losses()
    loss_diff = {s: abs(b[s] - a[s]) for s in range(after_step, steps + 1) if s in a and s in b}
    if len(loss_diff) != steps - after_step + 1:
        raise RuntimeError(f"the relaunched run logged losses for {sorted(b)}, the uninterrupted one for {sorted(a)}: "
                           f"cannot compare steps {after_step}-{steps}")
    final_full = checkpoint_tensors(full_folder / "checkpoint" / f"step-{steps}")
    final_killed = checkpoint_tensors(folder / "checkpoint" / f"step-{steps}")
    trained = [k for k in final_full if not k.startswith(_UNTRAINED)]
    differing = {k: float((final_full[k].double() - final_killed[k].double()).abs().max()) for k in trained
                 if k in final_killed and not torch.equal(final_full[k], final_killed[k])}
    return KillResume(
        killed_returncode=killed.returncode, killed_after_step=killed_at, final_checkpoint_before_relaunch=final_written,
        relaunched=relaunched, loaded_checkpoint="Loading the checkpoint from" in relaunched.output,
        replayed_steps=sorted(set(logged)), loss_diff=loss_diff, trained_keys=len(trained),
        has_optimizer_and_gift_state=(any(k.startswith("optimizer") for k in trained)
                                      and any(k.startswith("gift") for k in trained)),
        differing=differing, key_sets_equal=set(final_full) == set(final_killed))


def worker_pids(torchrun_pid: int) -> dict[int, int]:
    """`{local rank: pid}` of a torchrun agent's worker processes (from /proc)."""
    out = {}
    with open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = pid
    return out


def run_killing_rank(config: str, args: Sequence[str], folder: Path, *, after_step: int, rank: int = 1,
                     nproc: int = 2) -> tuple[RunResult, int]:
    """Run under ``torchrun``; once the run logged ``after_step``, SIGKILL the worker of
    ``rank``. Returns the (failed) run and the last step logged before the kill."""
    folder.mkdir(parents=True)
    command = config_command(config, args, dump_folder=str(folder), nproc=nproc)
    jsonl = folder / "gift_metrics.jsonl"
    start = time.perf_counter()
    with subprocess.Popen(command, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
        reader.start()
        killed_at = -1
        while proc.poll() is None and killed_at < 0:
            try:
                steps = [r["step"] for r in read_jsonl(str(jsonl)) if "loss" in r] if jsonl.exists() else []
            except json.JSONDecodeError:  # a line being written
                steps = []
            if steps and max(steps) >= after_step:
                os.kill(worker_pids(proc.pid)[rank], signal.SIGKILL)
                killed_at = max(steps)
            time.sleep(0.05)
        proc.wait(timeout=1800)
        reader.join(timeout=10)
    return RunResult(command, proc.returncode, "".join(output), time.perf_counter() - start, []), killed_at


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint folder, by flattened key (read without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    flat: dict[str, torch.Tensor] = {}

    def walk(obj: object, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))

    walk(torch.load(target, weights_only=False), "")
    return flat
