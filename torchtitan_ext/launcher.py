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

Like :mod:`.train`, the launcher imports the CPU stand-in ``.cpu.cpu_compat`` inside `main` and
nowhere else: a process entry point applies the platform shims before torchtitan is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from .keys import CLI, check_ranges, cli_key, cli_settings, split_recipe_flag, toml_settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib

__all__ = ["LaunchPlan", "RecipeUse", "build_plan", "check_recipe", "expand_recipe", "main"]

logger = logging.getLogger("gift_compile")

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

    overrides, recipe = expand_recipe(table, list(overrides), toml_path)
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
    if recipe is not None:
        check_recipe(recipe, config, cli_values, toml_path)
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


@dataclasses.dataclass(frozen=True)
class RecipeUse:
    """The recipe a launch expands and the ``[gift]`` keys its TOML set that stand next to it
    (what `check_recipe` holds the recipe against, with the ``--gift.*`` flags)."""

    name: str
    toml_keys: dict[str, Any]
    """``[gift]`` keys the TOML file sets, other than ``recipe``, that the recipe did not replace."""


def expand_recipe(table: dict[str, Any], overrides: list[str], toml_path: str) -> tuple[list[str], RecipeUse | None]:
    """Replace a named recipe (`gift_compile.recipes`) by the ``[gift]`` keys it sets; returns
    `overrides` without ``--gift.recipe``, and the recipe used (None: none). Precedence as
    everywhere: a recipe in the TOML fills the ``[gift]`` keys the TOML does not set; one on the
    command line replaces the TOML's recipe and the TOML's keys it sets (each replaced key
    logged, as it is no longer what the file says), and the other ``--gift.*`` flags beat
    either (`check_recipe`)."""
    from gift_compile.recipes import recipe_fields

    gift = table.setdefault("gift", {})
    if not isinstance(gift, dict):
        raise ValueError(f"{toml_path}: [gift] must be a table")
    name, rest = split_recipe_flag(overrides)
    in_toml = gift.pop("recipe", None)
    if in_toml is not None and not isinstance(in_toml, str):
        raise ValueError(f"{toml_path}: gift.recipe must be a string, got {in_toml!r}")
    for given, source in ((in_toml, toml_path), (name, CLI)):
        if given:
            try:  # each name checked, also the TOML's that the command line's replaces
                recipe_fields(given)
            except ValueError as err:
                raise ValueError(f"{source}: {err}") from None
    chosen = name if name is not None else in_toml
    if not chosen:
        return rest, None
    fields = recipe_fields(chosen)
    typed = dict(gift)
    if name is not None:  # the command line's recipe beats the TOML's keys
        replaced = [f"{k}={v!r} (recipe: {fields[k]!r})" for k, v in typed.items() if k in fields and fields[k] != v]
        if replaced:
            logger.warning("GIFT: --gift.recipe %r replaces %s from %s (a --gift.* flag would beat the recipe)",
                           name, ", ".join(replaced), toml_path)
        typed = {k: v for k, v in typed.items() if k not in fields}
    gift.clear()
    gift.update({**fields, **typed, "recipe": chosen})  # kept by name: the run checks the recipe's optimizer
    return rest, RecipeUse(chosen, typed)


def check_recipe(use: RecipeUse, config: Any, cli_values: dict[str, Any], toml_path: str) -> None:
    """Hold recipe `use` against what the user set next to it, as `gift_compile.recipes.recipe`
    does in Python (`with_overrides`), before the section's own checks (`check_ranges`) would
    blame a recipe field the user never typed: a TOML key or ``--gift.*`` flag (`cli_values`,
    the checked settings by key) replacing a field of the recipe is logged with both values and
    where it was typed; values the recipe's fields do not admit raise `RecipeConflict` naming the
    recipe and those values; a value the recipe refuses on its own raises naming its key, where
    it was set and the recipe. The rest of the section is the config function's (`config.gift`)."""
    from gift_compile.config import GiftConfigError
    from gift_compile.recipes import RecipeConflict, with_overrides

    from .section import GiftSection

    flags = {key.removeprefix("gift."): value for key, value in cli_values.items() if key.startswith("gift.")}
    typed = {**use.toml_keys, **flags}  # a flag beats the TOML's key
    sources = {k: f"in {toml_path}" for k in use.toml_keys}
    sources.update({k: f"--gift.{'no-' if v is False else ''}{k.replace('_', '-')} on the {CLI}"
                    for k, v in flags.items()})
    base = {f.name: getattr(config.gift, f.name) for f in dataclasses.fields(GiftSection)}
    try:
        with_overrides(use.name, typed, lambda values: GiftSection(**{**base, **values}), sources)
    except RecipeConflict:
        raise
    except GiftConfigError as err:
        if err.field not in typed:
            raise
        source = CLI if err.field in flags else toml_path
        raise ValueError(f"{source}: key 'gift.{err.field}' = {typed[err.field]!r}: {err}") from err


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


def gift_flags_help() -> str:
    """Every ``--gift.*`` flag with its type, default and help (the `GiftSection` field
    docstrings tyro shows), without importing torchtitan: `gift-train --help` answers at once
    and shows what GIFT adds, where torchtitan's own help (`--help-all`) runs to pages."""
    import ast
    import inspect
    import textwrap
    from dataclasses import MISSING, fields

    from .section import GiftSection

    tree = ast.parse(textwrap.dedent(inspect.getsource(GiftSection)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[attr-defined]
    lines = ["[gift] section: --gift.<field> VALUE on the command line, <field> = VALUE under [gift] in the TOML",
             "(booleans: --gift.<field> / --gift.no-<field>; lists: comma-separated):", ""]
    for f in fields(GiftSection):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        shown = ",".join(default) if isinstance(default, list) else default
        lines.append(f"  --gift.{f.name.replace('_', '-')} {getattr(f.type, '__name__', f.type)} (default: {shown})")
        lines.extend(textwrap.wrap(docs.get(f.name, ""), 96, initial_indent=" " * 6, subsequent_indent=" " * 6))
    from gift_compile.recipes import RECIPES

    lines += ["", "Named recipes (--gift.recipe NAME, or recipe = \"NAME\" under [gift]): "
              + "; ".join(f"{n} ({r.optimizer})" for n, r in RECIPES.items()) + " (docs/torchtitan/start.md).",
              "torchtitan's own flags (--training.*, --parallelism.*, ...): gift-train --toml FILE --help-all"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gift-train``."""
    parser = argparse.ArgumentParser(
        prog="gift-train",
        allow_abbrev=False,
        add_help=False,
        description="Run torchtitan with GIFT from a TOML file; extra --section.key value pairs override it.",
    )
    parser.add_argument("-h", "--help", action="store_true", help="this help, with every --gift.* flag")
    parser.add_argument("--help-all", action="store_true",
                        help="torchtitan's full help (every --section.key) for the TOML's config function")
    parser.add_argument("--toml", help="TOML file ([job] module/config + config sections); required")
    parser.add_argument("--nproc", type=int, default=None,
                        help="number of ranks (default: job.nproc or 1; the FSDP2 trainer needs 2 or more)")
    parser.add_argument("--dry-run", action="store_true", help="check and print the command, do not run it")
    known, overrides = parser.parse_known_args(argv)
    if known.help:
        print(parser.format_help() + "\n" + gift_flags_help(), flush=True)
        return 0
    if known.toml is None:
        parser.error("the following arguments are required: --toml (gift-train --help lists the flags)")
    if known.help_all:
        overrides = [*overrides, "--help"]

    from .cpu import cpu_compat  # launcher side, like .train: the shims precede torchtitan's import

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
