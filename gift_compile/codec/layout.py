"""The codec's lowest layer: the 2-D row view every format works on, `Scaling`, and `Choice`
(the base of GIFT's mode enums, `Nonfinite` the codec's own).

Split out so that the scale machinery (`scales.py`), the element grids (`codes.py`) and the
format families built on both (`formats.py`) can share the row view and the scaling
granularity without importing `FormatSpec` (`spec.py`), which sits above the family table.
"""

from __future__ import annotations

import enum
import math
import operator
from typing import Self

import torch

FP32_MAX = torch.finfo(torch.float32).max


class Scaling(enum.StrEnum):
    """How many scales an fp8 format keeps: one per tensor, per row, or per block of a row.

    A `StrEnum`, so a member equals, prints and serialises as its spelling ("row"): configs,
    plan descriptions and JSON keep the strings they had; `parse` turns a spelling into the
    member and names the choices when it is not one.
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"

    @classmethod
    def parse(cls, value: object) -> Scaling:
        """The member spelled `value` (a member passes through); ValueError naming `value` otherwise.

        A dict lookup rather than `Scaling(value)`, so that Dynamo folds it when a `FormatSpec`
        is built inside a traced function."""
        member = _SCALINGS.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"unknown scaling {value!r}; allowed: {', '.join(_SCALINGS)}")
        return member


_SCALINGS: dict[str, Scaling] = {s.value: s for s in Scaling}


class Choice(enum.StrEnum):
    """Base of GIFT's modes (`Nonfinite` here, the config's in `gift_compile.config`, the
    exchange's and the frameworks' above): a `StrEnum`, so a member equals, prints and
    serialises as its spelling and configs, JSON and checkpoints keep the strings they had.
    A spelling is turned into its member once, where it enters (`lookup` / `parse`); code
    compares members (`is`), never spellings. `repr` is the spelling's too, so a config's repr
    and the messages that quote a mode with `!r` read as they did with strings."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def lookup(cls, value: object) -> Self | None:
        """The member spelled `value` (a member is its own spelling), None for anything else."""
        return cls._value2member_map_.get(value) if isinstance(value, str) else None

    @classmethod
    def parse(cls, value: object, what: str) -> Self:
        """The member spelled `value`; a ValueError naming `what`, the value and the choices otherwise."""
        member = cls.lookup(value)
        if member is None:
            raise ValueError(f"{what}={value!r}; allowed: {', '.join(cls)}")
        return member


class Nonfinite(Choice):
    """What a NaN/Inf in a gradient does (`GiftConfig.nonfinite`, `quantize(nonfinite=)`):
    `ERROR` raises (eagerly, or on every rank at the step), `PROPAGATE` decodes the rows or
    blocks sharing its scale as NaN. Defined in the codec because `quantize` reads it; a
    `StrEnum`, so configs and JSON keep the spellings."""

    ERROR = "error"
    PROPAGATE = "propagate"


def _count(name: str, value: object) -> int:
    """`value` as a non-negative int, or a ValueError naming `name`."""
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a non-negative integer") from None
    if n < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
    return n


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """The 2-D view every format works on: `[prod(leading dims), last dim]` (0-d: `[1, 1]`)."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, x.shape[0])
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _blocks(x2: torch.Tensor, block: int) -> torch.Tensor:
    """`[..., rows, cols]` (cols a multiple of block) as `[..., rows, nblocks, block]`."""
    return x2.reshape(*x2.shape[:-1], x2.shape[-1] // block, block)
