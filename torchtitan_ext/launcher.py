"""``gift-train``: run torchtitan from a TOML file of toggles.

torchtitan 0.3.0 is configured only by a Python config function (``--module M --config
fn``) plus ``--section.key value`` overrides; it reads no TOML. This launcher turns a TOML
file into exactly those overrides::

    gift-train --toml configs/llama3_debug_gift.toml [--section.key value ...] [--nproc N] [--dry-run]

TOML layout: ``[job]`` names ``module`` and ``config`` (and optionally ``nproc``); every
other table mirrors torchtitan's config tree (``[training]``, ``[gift]``,
``[validator.dataloader]``, ...), and top-level keys are root fields (``dump_folder``).
Precedence: command line > TOML > config function defaults. Every TOML key is checked
against the config object the config function returns, so a typo fails before anything
starts, naming the key and the file; then the full command line is parsed once by
torchtitan's own ``ConfigManager`` (tyro), so bad values (``gift.format = "fp9"``) fail
here too, not in N ranks. ``--nproc 1`` trains in this process; ``--nproc N`` runs
``torchrun --standalone --nproc-per-node N -m gift_compile.torchtitan_ext.train``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib

__all__ = ["LaunchPlan", "build_plan", "main", "toml_to_args"]

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


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{path}.")
        else:
            yield path, value


def _describe(obj: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(obj) if not f.name.startswith("_"))


def _check_key(config: Any, key: str, source: str) -> None:
    """Raise ValueError unless ``key`` (dotted) names a leaf field of ``config``."""
    node, walked = config, []
    parts = key.split(".")
    for i, part in enumerate(parts):
        field_names = {f.name for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()
        where = f"[{'.'.join(walked)}]" if walked else "the top level"
        if part not in field_names or part == "model_spec":
            known = _describe(node) if dataclasses.is_dataclass(node) else "none (not a config section)"
            raise ValueError(f"{source}: unknown key '{key}': no field '{part}' in {where}; known: {known}")
        node = getattr(node, part)
        walked.append(part)
        if i < len(parts) - 1 and not dataclasses.is_dataclass(node):
            raise ValueError(f"{source}: unknown key '{key}': '{'.'.join(walked)}' is a value, not a section")
    if dataclasses.is_dataclass(node):
        raise ValueError(f"{source}: key '{key}' is a section; set its fields in a [{key}] table")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _value_args(key: str, value: Any, source: str) -> list[str]:
    """``key = value`` as tyro arguments (bools are flags, lists of str comma-joined)."""
    if isinstance(value, bool):
        head, _, leaf = key.rpartition(".")
        return [_flag(key) if value else _flag(f"{head}.no_{leaf}" if head else f"no_{leaf}")]
    if isinstance(value, (int, float, str)):
        return [_flag(key), str(value)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        # torchtitan registers a tyro rule that parses list[str] from "a,b,c".
        return [_flag(key), ",".join(value)]
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [_flag(key), *(str(v) for v in value)]
    raise ValueError(f"{source}: key '{key}': unsupported TOML value {value!r} (use a scalar or a list of scalars)")


def _cli_key(arg: str, config: Any) -> str | None:
    """The dotted config key an override such as ``--gift.no-enable`` sets (None if not a flag)."""
    if not arg.startswith("--"):
        return None
    key = arg[2:].split("=", 1)[0].replace("-", "_")
    head, _, leaf = key.rpartition(".")
    if leaf.startswith("no_"):
        positive = f"{head}.{leaf[3:]}" if head else leaf[3:]
        try:
            _check_key(config, key, "command line")
        except ValueError:
            return positive
    return key


def toml_to_args(table: dict[str, Any], config: Any, source: str) -> dict[str, list[str]]:
    """Checked TOML tables (without ``[job]``) -> ``{key: tyro arguments}``."""
    out: dict[str, list[str]] = {}
    for key, value in _flatten({k: v for k, v in table.items() if k != "job"}):
        _check_key(config, key, source)
        out[key] = _value_args(key, value, source)
    return out


def _load_config_object(module: str, config_fn: str) -> Any:
    """The config object of ``--module module --config config_fn`` with no overrides."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", module, "--config", config_fn])


def build_plan(toml_path: str, overrides: Sequence[str], nproc: int | None) -> LaunchPlan:
    """Read ``toml_path``, check its keys, merge ``overrides`` (they win) into a LaunchPlan."""
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
    from_toml = toml_to_args(table, config, toml_path)
    for arg in passthrough:
        key = _cli_key(arg, config)
        if key is not None:
            from_toml.pop(key, None)
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
