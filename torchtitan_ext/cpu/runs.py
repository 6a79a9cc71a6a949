"""Launch a torchtitan run of one of our config functions and collect its results.

Used by the integration tests and usable by benchmarks: it runs the same command a user
runs (``torchrun ... -m gift_compile.torchtitan_ext.train --module ... --config ...``),
waits, and returns the per-step records that :class:`.telemetry.GiftMetricsProcessor`
wrote, so callers compare losses and telemetry without parsing logs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gift_compile.config import RAW_OUTSIDE_LAYERS
from gift_compile.runtime.report import HEADER as REPORT_HEADER

from ..telemetry import read_jsonl

__all__ = ["EXACT_FP32", "RunResult", "config_command", "run_config", "seed_checkpoint", "shared_runs"]

MODULE = "gift_compile.torchtitan_ext.cpu"  # the config registry (`--module`)
TRAIN = "gift_compile.torchtitan_ext.train"  # the entry point (`-m`)
# GIFT at fp32 with every class of gradient at fp32: the layers (`format`) and the opt-outs of the
# whole-gradient defaults (the embedding and head go at bf16, tiny gradients at bf16 otherwise), so
# a run with GIFT on reproduces GIFT off bit for bit
EXACT_FP32 = ("--gift.format=fp32",
              *(f"--gift.{key.replace('_', '-')}={value}" for key, value in RAW_OUTSIDE_LAYERS.items()))


@dataclass
class RunResult:
    """Outcome of :func:`run_config`."""

    command: list[str]
    returncode: int
    output: str
    wall_s: float
    records: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Pipeline parallelism: each pipeline rank's records (its stage's GIFT telemetry), by rank."""

    def losses(self) -> dict[int, float]:
        """Training loss by step (a resumed run's records override earlier ones)."""
        return {r["step"]: r["loss"] for r in self.records if "loss" in r}

    def last(self, key: str) -> Any:
        """Value of ``key`` in the last record that has it."""
        return next(r[key] for r in reversed(self.records) if key in r)

    def gift_warnings(self) -> list[str]:
        """Log lines of GIFT warnings, fallbacks included (a weight sent at full precision is
        logged so): a run that must have used GIFT everywhere has none. The apply report's first
        line (`gift_compile.runtime.report.HEADER`, logged at WARNING by every successful `apply`)
        is no warning of trouble; what it lists that is (full-precision weights, unmatched globs)
        has checks of its own."""
        return [line for line in self.output.splitlines()
                if "GIFT" in line and ("WARNING" in line or "full precision" in line) and REPORT_HEADER not in line]

    def check(self) -> "RunResult":
        """Raise with the tail of the output unless the run succeeded."""
        if self.returncode != 0:
            raise RuntimeError(f"run failed ({self.returncode}): {' '.join(self.command)}\n{self.output[-6000:]}")
        return self


def config_command(config: str, overrides: Sequence[str] = (), *, dump_folder: str, nproc: int = 2) -> list[str]:
    """The ``torchrun`` command of a run (callers that watch or signal the run launch it)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", TRAIN, "--module", MODULE, "--config", config,
        "--dump-folder", dump_folder, "--metrics.disable-color-printing", *overrides,
    ]


def run_env() -> dict[str, str]:
    """The environment of a run: one intra-op thread per rank unless set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_config(
    config: str,
    overrides: Sequence[str] = (),
    *,
    dump_folder: str,
    nproc: int = 2,
    timeout_s: float = 600,
) -> RunResult:
    """Train ``--config config`` on ``nproc`` gloo/NCCL ranks into ``dump_folder``.

    ``overrides`` are torchtitan CLI arguments (``--training.steps 4``). One intra-op thread
    per rank unless ``OMP_NUM_THREADS`` is set (two ranks share two cores here).
    """
    command = config_command(config, overrides, dump_folder=dump_folder, nproc=nproc)
    env = run_env()
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    jsonl = os.path.join(dump_folder, "gift_metrics.jsonl")
    records = read_jsonl(jsonl) if os.path.exists(jsonl) else []
    stages = {int(m.group(1)): read_jsonl(os.path.join(dump_folder, f)) for f in sorted(os.listdir(dump_folder))
              if (m := re.fullmatch(r"gift_metrics\.pp(\d+)\.jsonl", f))} if os.path.isdir(dump_folder) else {}
    return RunResult(command, proc.returncode, proc.stdout + proc.stderr, wall, records, stages)


def shared_runs(table: dict[str, tuple[str, Sequence[str]]], folder_for: Callable[[str], str], *,
                nproc: int) -> Callable[[str], RunResult]:
    """A getter that runs ``table[name]`` (``(config, overrides)``) on first use and returns the
    checked result ever after: one multi-rank run serves every test that reads it (each costs
    30 s or more on two cores). ``folder_for(name)`` gives the run's dump folder."""
    cache: dict[str, RunResult] = {}

    def get(name: str) -> RunResult:
        if name not in cache:
            config, overrides = table[name]
            cache[name] = run_config(config, overrides, dump_folder=folder_for(name), nproc=nproc).check()
        return cache[name]

    return get


def seed_checkpoint(folder: Path, config: str = "llama3_debug_nogift_fsdp2") -> list[str]:
    """Write torchtitan's seed checkpoint of `config`'s model into `folder` (one rank) and return
    the overrides that start a run from it. On CPU torchtitan's initial weights depend on the
    parallel layout, so runs of different layouts are comparable only from a common checkpoint;
    and a sharded init repeats itself across shards (CPU DTensors draw every shard from the same
    generator state: under EP 2 the MoE's local experts, and its router's rows, come in identical
    pairs, so the router ties and two experts see the same tokens), which one rank does not."""
    run_config(config, ["--checkpoint.enable", "--checkpoint.create-seed-checkpoint", "--training.steps=1",
                        "--validator.no-enable"], dump_folder=str(folder), nproc=1).check()
    return ["--checkpoint.enable", f"--checkpoint.initial-load-path={folder / 'checkpoint' / 'step-0'}"]
