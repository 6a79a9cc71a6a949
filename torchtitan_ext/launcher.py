"""``gift-train``: run torchtitan from a TOML file of toggles.

torchtitan 0.3.0 is configured only by a Python config function (``--module M --config
fn``) plus ``--section.key value`` overrides; it reads no TOML. This launcher turns a TOML
file into exactly those overrides::

    gift-train --toml configs/llama3_debug_gift.toml [--section.key value ...] [--nproc N] [--dry-run]

TOML layout: ``[job]`` names ``module`` and ``config`` (and optionally ``nproc``); every
other table mirrors torchtitan's config tree (``[training]``, ``[gift]``,
``[validator.dataloader]``, ...), and top-level keys are root fields (``dump_folder``).
Precedence: command line > TOML > config function defaults. Every TOML key and every
``--section.key`` override is checked against the config object the config function
returns, before anything runs (:mod:`.keys`): the key must name a leaf field, the value must have the
field's annotated type (``gift.error_feedback = 1`` fails naming the key, the file, the
value and ``bool``), and the merged values must be in range (``training.steps >= 1``; the
``[gift]`` section through ``GiftConfig``). Only then is the full command line parsed once by
torchtitan's own ``ConfigManager`` (tyro), as every rank will parse it, so whatever the
checks here cannot judge (union-of-section fields, multi-token lists) still fails here, not
in N ranks. ``--nproc 1`` trains in this process; ``--nproc N`` runs
``torchrun --standalone --nproc-per-node N -m gift_compile.torchtitan_ext.train``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from .keys import CLI, check_ranges, cli_key, cli_settings, toml_settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib

__all__ = ["LaunchPlan", "build_plan", "main"]

_JOB_KEYS = {"module", "config", "nproc"}


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What ``gift-train`` will run: torchtitan arguments and the number of ranks."""

    args: list[str]
    """``--module M --config fn --section.key value ...`` for torchtitan's ConfigManager."""
    nproc: int

    def command(self) -> list[str]:
        """The full command line (torchrun for nproc > 1)."""
        entry = ["-m", "gift_compile.torchtitan_ext.train", *self.args]
        if self.nproc == 1:
            return [sys.executable, *entry]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}", *entry]


def _load_config_object(module: str, config_fn: str) -> Any:
    """The config object of ``--module module --config config_fn`` with no overrides."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", module, "--config", config_fn])


def build_plan(toml_path: str, overrides: Sequence[str], nproc: int | None) -> LaunchPlan:
    """Read ``toml_path``, check its keys, value types and ranges and those of ``overrides``
    (they win), and merge both into a LaunchPlan."""
    with open(toml_path, "rb") as f:
        table = tomllib.load(f)
    job = table.get("job", {})
    if not isinstance(job, dict):
        raise ValueError(f"{toml_path}: [job] must be a table with 'module' and 'config'")
    unknown = sorted(set(job) - _JOB_KEYS)
    if unknown:
        raise ValueError(f"{toml_path}: unknown key 'job.{unknown[0]}'; [job] knows {sorted(_JOB_KEYS)}")

    overrides = list(overrides)
    module, config_fn = job.get("module"), job.get("config")
    passthrough: list[str] = []
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        name, eq, inline = arg.partition("=")
        if name in ("--module", "--config"):
            value = inline if eq else (overrides[i + 1] if i + 1 < len(overrides) else None)
            if value is None:
                raise ValueError(f"{name} requires a value")
            if name == "--module":
                module = value
            else:
                config_fn = value
            i += 1 if eq else 2
            continue
        passthrough.append(arg)
        i += 1
    if not module or not config_fn:
        raise ValueError(f"{toml_path}: [job] must name 'module' and 'config' (or pass --module/--config)")

    config = _load_config_object(module, config_fn)
    checked_toml = toml_settings(table, config, toml_path)
    from_toml = {key: args for key, (_, args) in checked_toml.items()}
    cli_values = cli_settings(passthrough, config)
    for arg in passthrough:
        found = cli_key(arg, config)
        if found is not None:
            from_toml.pop(found[0], None)
    merged = {key: (value, toml_path) for key, (value, _) in checked_toml.items()}
    merged.update({key: (value, CLI) for key, value in cli_values.items()})
    check_ranges(config, merged, f"config function {module}.{config_fn}")
    args = ["--module", module, "--config", config_fn]
    for values in from_toml.values():
        args.extend(values)
    args.extend(passthrough)

    ranks = nproc if nproc is not None else job.get("nproc", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"{toml_path}: job.nproc must be a positive integer, got {ranks!r}")
    return LaunchPlan(args=args, nproc=ranks)


def _validate(plan: LaunchPlan) -> None:
    """Parse the final arguments with torchtitan's ConfigManager (tyro), as every rank will."""
    from torchtitan.config import ConfigManager

    ConfigManager().parse_args(list(plan.args))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_process(plan: LaunchPlan) -> int:
    from . import train

    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        os.environ.setdefault(key, value)
    sys.argv = ["gift_compile.torchtitan_ext.train", *plan.args]
    train.main()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gift-train``."""
    parser = argparse.ArgumentParser(
        prog="gift-train",
        allow_abbrev=False,
        description="Run torchtitan with GIFT from a TOML file; extra --section.key value pairs override it.",
    )
    parser.add_argument("--toml", required=True, help="TOML file ([job] module/config + config sections)")
    parser.add_argument("--nproc", type=int, default=None, help="number of ranks (default: job.nproc or 1)")
    parser.add_argument("--dry-run", action="store_true", help="check and print the command, do not run it")
    known, overrides = parser.parse_known_args(argv)

    from . import cpu_compat

    cpu_compat.activate()
    try:
        plan = build_plan(known.toml, overrides, known.nproc)
    except (ValueError, FileNotFoundError, tomllib.TOMLDecodeError) as err:
        parser.error(str(err))
    _validate(plan)
    print(" ".join(plan.command()), flush=True)
    if known.dry_run:
        return 0
    if plan.nproc == 1:
        return _run_in_process(plan)
    return subprocess.call(plan.command())


if __name__ == "__main__":
    sys.exit(main())
