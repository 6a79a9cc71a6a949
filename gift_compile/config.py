"""`GiftConfig`: every knob of GIFT in one validated, immutable dataclass.

Validation happens at construction so that a typo in a TOML file or a CLI flag fails
before any process group is created, with a message that names the field and lists the
allowed values, instead of surfacing as a shape error deep inside a compiled graph.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "mxint4", "int4", "int2", "ternary")
# Formats whose block length is `block_size`; their block statistics are reduced by a
# pairwise tree and packed whole into bytes, hence a short list of power-of-two lengths.
BLOCK_SIZE_FORMATS = ("int4", "int2", "ternary")
BLOCK_SIZE_CHOICES = (16, 32)
SCALINGS = ("tensor", "row", "block")
GEOMETRIES = ("none", "hadamard", "dense", "lowrank", "gradient")
NONFINITE = ("error", "propagate")
REDUCE_OPS = ("avg", "sum")
SELECT_METRICS = ("euclidean", "whitened")
_SELECT_KEYWORDS = ("auto", "all", "none")
_BOUNDARY_RE = re.compile(r"^boundary_hits:(\d+)$")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"GiftConfig.{name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class GiftConfig:
    """How gradients are communicated.

    Attributes:
        format: wire format of the gradient codes (see `gift_compile.formats`).
        scaling: scale granularity for the fp8 formats: one per tensor, per row, or per
            block of `block_size` elements along the last dimension. The block-scaled
            formats (mxfp8, nvfp4, mxint4, int4, int2, ternary) ignore this field.
        block_size: block length for fp8 with `scaling="block"` (any even size), and for
            int4/int2/ternary (16 or 32). mxfp8/mxint4 use 32 and nvfp4 16 regardless.
        geometry: coordinates in which the gradient is quantized. `none` is the Euclidean
            baseline, `hadamard` a random-sign block Hadamard rotation, `dense` a full
            Cholesky whitening of the K-FAC input factor, `lowrank` the rank-`rank` plus
            diagonal whitening applied in O(d_in * rank), `gradient` the same low-rank map
            built from the gradient-side factor E[G^T G] (no forward hooks).
        rank: rank of the low-rank part of the whitening.
        refresh_every: steps between geometry refreshes (statistics, transforms, selection).
        ema: decay of the exponential moving average of the statistics.
        damping: relative floor of the diagonal (times the mean eigenvalue).
        select: which managed layers take the transformed path: "auto" (measured per layer
            at each refresh), "all", "none" (Euclidean low-bit everywhere),
            "boundary_hits:K" (the paper's rule: top-K layers by E5M2 saturation share), or
            a tuple of fnmatch globs over parameter FQNs.
        exclude: globs of parameter FQNs that always stay at full precision.
        error_feedback: keep the quantization residual (in transformed coordinates) and add
            it to the next step's gradient.
        stochastic_rounding: round fp codes stochastically (seeded, reproducible).
        min_numel: 2-D weights smaller than this stay at full precision.
        stats_tokens: at most this many tokens per step and layer enter the K-FAC statistics
            (a strided subsample), which bounds the hook's cost at O(stats_tokens * d_in^2).
        nonfinite: "error" raises when an eagerly called quantizer sees NaN/Inf; in compiled
            graphs, or with "propagate", a non-finite input turns the affected rows of the
            result into NaN on every rank (never a silently finite value).
        reduce_op: "avg" (data-parallel mean) or "sum".
        seed: base seed of stochastic rounding and of the Hadamard signs.
        select_metric: how select="auto" compares the two paths: "euclidean" (relative L2
            error of the gradient) or "whitened" (the error seen in the layer's whitened
            geometry, which is what preconditioned optimizers such as Muon/Shampoo amplify).
        auto_min_gain: with select="auto", the transformed path must cut the measured error
            by at least this factor to be enabled.
        auto_max_overhead: with select="auto", the transform's FLOPs may be at most this
            fraction of the layer's backward FLOPs.
    """

    format: str = "fp8_e4m3"
    scaling: str = "row"
    block_size: int = 32
    geometry: str = "lowrank"
    rank: int = 32
    refresh_every: int = 50
    ema: float = 0.95
    damping: float = 1e-3
    select: str | tuple[str, ...] = "auto"
    exclude: tuple[str, ...] = ("*embed*", "*output*", "*lm_head*")
    error_feedback: bool = False
    stochastic_rounding: bool = False
    min_numel: int = 4096
    stats_tokens: int = 1024
    nonfinite: str = "error"
    reduce_op: str = "avg"
    seed: int = 0
    select_metric: str = "euclidean"
    auto_min_gain: float = 1.05
    auto_max_overhead: float = 0.25

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            _fail("format", self.format, ", ".join(FORMATS))
        if self.scaling not in SCALINGS:
            _fail("scaling", self.scaling, ", ".join(SCALINGS))
        if self.geometry not in GEOMETRIES:
            _fail("geometry", self.geometry, ", ".join(GEOMETRIES))
        if self.nonfinite not in NONFINITE:
            _fail("nonfinite", self.nonfinite, ", ".join(NONFINITE))
        if self.select_metric not in SELECT_METRICS:
            _fail("select_metric", self.select_metric, ", ".join(SELECT_METRICS))
        if self.reduce_op not in REDUCE_OPS:
            _fail("reduce_op", self.reduce_op, ", ".join(REDUCE_OPS))
        for name in ("block_size", "rank", "refresh_every", "stats_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "a positive integer")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            _fail("min_numel", self.min_numel, "a non-negative integer")
        if self.block_size % 2:
            _fail("block_size", self.block_size, "an even positive integer")
        if self.format in BLOCK_SIZE_FORMATS and self.block_size not in BLOCK_SIZE_CHOICES:
            _fail("block_size", self.block_size, f"{' or '.join(map(str, BLOCK_SIZE_CHOICES))} for format={self.format!r}")
        if not 0.0 <= self.ema < 1.0:
            _fail("ema", self.ema, "a float in [0, 1)")
        if not 0.0 < self.damping < 1.0:
            _fail("damping", self.damping, "a float in (0, 1)")
        if self.auto_min_gain < 1.0:
            _fail("auto_min_gain", self.auto_min_gain, "a float >= 1")
        if self.auto_max_overhead <= 0.0:
            _fail("auto_max_overhead", self.auto_max_overhead, "a positive float")
        for name in ("error_feedback", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        self._validate_select()
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        if isinstance(self.exclude, list):
            object.__setattr__(self, "exclude", tuple(self.exclude))

    def _validate_select(self) -> None:
        allowed = '"auto", "all", "none", "boundary_hits:K" (K >= 1) or a list of FQN globs'
        select = self.select
        if isinstance(select, list):
            select = tuple(select)
            object.__setattr__(self, "select", select)
        if isinstance(select, str):
            if "," in select:  # "a.*,b.*" from a CLI flag: a glob list
                object.__setattr__(self, "select", tuple(s.strip() for s in select.split(",") if s.strip()))
                return
            if select in _SELECT_KEYWORDS:
                return
            m = _BOUNDARY_RE.match(select)
            if m and int(m.group(1)) >= 1:
                return
            if select.startswith("boundary_hits"):
                _fail("select", select, allowed)
            if any(c in select for c in "*?[") or "." in select:
                object.__setattr__(self, "select", (select,))
                return
            _fail("select", select, allowed)
        elif isinstance(select, tuple):
            if not select or not all(isinstance(s, str) and s for s in select):
                _fail("select", select, allowed)
        else:
            _fail("select", select, allowed)

    @property
    def boundary_hits_k(self) -> int | None:
        """K of `select="boundary_hits:K"`, else None."""
        if isinstance(self.select, str):
            m = _BOUNDARY_RE.match(self.select)
            if m:
                return int(m.group(1))
        return None

    def is_excluded(self, fqn: str) -> bool:
        return any(fnmatch.fnmatch(fqn, pat) for pat in self.exclude)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GiftConfig":
        """Build from a plain mapping (TOML, CLI); unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GiftConfig field(s) {unknown}; known: {sorted(names)}")
        return cls(**d)
