"""Named GIFT recipes: the configurations the frontier measured, by optimizer and bit width.

A new user should not have to read the frontier to pick a format, a block size and an error
feedback that go together; a recipe names one such choice (torchao's named configs are the
model). Each is a `GiftConfig` field set plus the optimizer family it was measured under (the
map of `geometry="auto"` follows the optimizer, so a Muon recipe under AdamW gets AdamW's map,
not the measured one). The same names work in Python and in a torchtitan TOML::

    gift_compile.apply(model, gift_compile.recipes.recipe("muon-int2-leaky-ef"), optimizer=[muon, adamw])

    [gift]
    recipe = "adamw-int3"        # gift-train expands it; keys set next to it (and --gift.* flags) win

Where the numbers come from (the frontier, docs/benchmarks.md#the-frontier; the README's
"How few bits stay within fp32's noise"): `muon-int2-leaky-ef` (int2 codes with a leaky residual
and the block rotation) and `adamw-int3` are the fewest bits per managed element whose loss gap
stayed inside fp32's own run-to-run 95% CI under each optimizer (2-rank reduce-scatter, 120 steps); `muon-nvfp4` is the headline's first row, where
the map closed 40-43% of plain NVFP4's gap on both paths.
"""

from __future__ import annotations

import dataclasses
import logging
from types import MappingProxyType
from collections.abc import Callable
from typing import Any, TypeVar

from gift_compile.config import GiftConfig, GiftConfigError

__all__ = ["RECIPES", "Recipe", "RecipeConflict", "check_recipe_optimizer", "recipe", "recipe_fields",
           "with_overrides"]

logger = logging.getLogger("gift_compile")

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One named configuration: the `GiftConfig` fields it sets and what it was measured under."""

    optimizer: str
    """The optimizer family the frontier measured it under ("muon" or "adamw")."""
    fields: MappingProxyType[str, Any]
    """`GiftConfig` keyword arguments (TOML-typed values: str, int, float, bool)."""
    why: str


RECIPES: MappingProxyType[str, Recipe] = MappingProxyType({
    "muon-nvfp4": Recipe("muon", MappingProxyType({"format": "nvfp4", "geometry": "auto"}),
                         "NVFP4 with the K-FAC map Muon's auto picks: 40-43% of plain NVFP4's loss gap closed"),
    "muon-int2-leaky-ef": Recipe(
        "muon", MappingProxyType({"format": "int2", "block_size": 32, "geometry": "auto", "error_feedback": True,
                                  "error_feedback_decay": 0.9, "block_rotation": True}),
        "2.25 bits per managed element within fp32's noise under Muon, ahead of the best Euclidean arm at "
        "those bits (the frontier's fewest)"),
    "adamw-int3": Recipe("adamw", MappingProxyType({"format": "int3", "block_size": 32, "geometry": "auto"}),
                         "3.25 bits per managed element within fp32's noise under AdamW (the frontier's fewest)"),
})
"""Every recipe by name."""


class RecipeConflict(GiftConfigError):
    """Overrides the user typed that a recipe's own fields do not admit. `field` is the first of
    them (a front end points at the flag the user typed), `recipe` the recipe's name."""

    def __init__(self, recipe: str, typed: dict[str, Any], err: GiftConfigError,
                 sources: dict[str, str] | None = None) -> None:
        first = next(iter(typed))
        super().__init__(first, typed[first], err.allowed)
        self.recipe = recipe
        given = ", ".join(_said(k, v, sources) for k, v in typed.items())
        self.args = (f"GIFT: recipe {recipe!r} does not combine with {given}: the recipe sets {err.field}="
                     f"{err.value!r} (allowed: {err.allowed}). Override {err.field} as well, or leave the recipe out "
                     "and set the fields yourself",)


def recipe_fields(name: str) -> dict[str, Any]:
    """The `GiftConfig` fields recipe `name` sets (raises naming the known recipes)."""
    if name not in RECIPES:
        raise ValueError(f"GIFT: no recipe named {name!r}; known: {', '.join(RECIPES)}")
    return dict(RECIPES[name].fields)


def check_recipe_optimizer(config: GiftConfig, family: str, optimizers: str) -> None:
    """Warn (on the calling rank: every rank calls it) when `config` came from a recipe measured
    under another optimizer family than `family` ("muon", "adamw" or another name), which the
    optimizers `optimizers` (their class names, for the message) belong to: "auto" follows the
    optimizer given, so the recipe's measured map is not what runs. Raises for an unknown name."""
    if not config.recipe:
        return
    if config.recipe not in RECIPES:
        raise ValueError(f"GIFT: GiftConfig.recipe={config.recipe!r} names no recipe; known: {', '.join(RECIPES)}")
    measured = RECIPES[config.recipe].optimizer
    if measured != family:
        logger.warning("GIFT: recipe %r was measured under %s, but the optimizer given is %s (%s): geometry='auto' "
                       "follows the optimizer, so this run gets %s's map, not the recipe's measured one; pick a "
                       "%s recipe (%s) or pass the optimizer the recipe names", config.recipe, measured, optimizers,
                       family, family, family,
                       ", ".join(n for n, r in RECIPES.items() if r.optimizer == family) or "none yet")


def recipe(name: str, **overrides: Any) -> GiftConfig:
    """The `GiftConfig` of recipe `name`, with `overrides` (any `GiftConfig` field) on top
    (`with_overrides`: replaced fields logged, a conflict raised naming the recipe)."""
    return with_overrides(name, overrides, lambda values: GiftConfig(**values))


def with_overrides(name: str, overrides: dict[str, Any], build: Callable[[dict[str, Any]], T],
                   sources: dict[str, str] | None = None) -> T:
    """`build` of recipe `name`'s fields with `overrides` on top: the one place a recipe meets
    the fields a user typed, so the Python API (`recipe`) and torchtitan's launcher (TOML keys
    and ``--gift.*`` flags next to a recipe, `build` then making its ``[gift]`` section) log and
    refuse alike. `build` takes `GiftConfig` keyword arguments (plus ``recipe``) and raises
    `GiftConfigError` naming the field it refuses; `sources` says where each override was typed
    ("--gift.format on the command line"), for the messages.

    An override that replaces a field the recipe sets is logged (the result is no longer what
    the recipe measured). An override the recipe's other fields do not admit (`error_feedback=False`
    on a recipe with a decaying residual) raises `RecipeConflict` naming the recipe and the
    overrides the user typed that cause it, not a recipe field as if the user had set it."""
    fields = recipe_fields(name)
    where = sources or {}
    replaced = [f"{k}={v!r} (recipe: {fields[k]!r}" + (f"; {where[k]})" if k in where else ")")
                for k, v in overrides.items() if k in fields and fields[k] != v]
    if replaced:
        logger.warning("GIFT: recipe %r with %s set explicitly: the explicit value%s win%s over the recipe's", name,
                       ", ".join(replaced), "s" if len(replaced) > 1 else "", "" if len(replaced) > 1 else "s")
    try:
        return build({**fields, "recipe": name, **overrides})
    except GiftConfigError as err:
        if err.field in overrides:  # the user's own value is bad: say so, with the recipe it was given to
            raise GiftConfigError(err.field, err.value, f"{err.allowed} (given to recipe {name!r})") from None
        culprits = [k for k, v in overrides.items() if not _admits(build, fields, k, v)] or list(overrides)
        if not culprits:  # nothing typed: what the recipe meets is the caller's base (a config function's values)
            raise GiftConfigError(err.field, err.value, f"{err.allowed} (set by recipe {name!r}, which does not "
                                  "combine with the values it is applied to)") from None
        raise RecipeConflict(name, {k: overrides[k] for k in culprits}, err, sources) from None


def _said(key: str, value: Any, sources: dict[str, str] | None) -> str:
    """``key=value``, with where the user typed it when that is known."""
    where = (sources or {}).get(key)
    return f"{key}={value!r}" + (f" ({where})" if where else "")


def _admits(build: Callable[[dict[str, Any]], object], fields: dict[str, Any], key: str, value: Any) -> bool:
    """Whether the recipe's `fields` with `key=value` alone on top make a valid object of `build`."""
    try:
        build({**fields, key: value})
    except GiftConfigError:
        return False
    return True
