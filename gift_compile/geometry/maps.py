"""The maps that need only the layer's own statistics or gradient: the identity (`Geometry`,
the base class every geometry derives from), `Hadamard`, `Dense`, `LowRank` and `Gradient`,
with the traced kernels they share (the block Walsh-Hadamard butterfly, the low-rank sum).

They live apart from `gift_compile.geometry.table`, which holds the one name -> class table and
re-exports every class, so that the table module stays small and the maps whose factor comes
from the optimizer (`gift_compile.geometry.optimizer_maps`) can derive from these.

Why one module: the five classes are one hierarchy over shared private traced kernels (`_traced`,
`_low_rank_sum`, `_map_path`, `_rows`), and `Geometry`'s base methods are best read next to the
overrides that change them; the name table and the optimizer-fed maps already live apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from gift_compile.codec.rotation import fwht
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics, StatisticsSettings, sketch_chosen
from gift_compile.geometry.whitening import dense_whitening, gradient_factor, lowrank_refresh_flops, lowrank_whitening
from gift_compile.kernels.map_dispatch import MapPath, MapPrecision, lowrank_map, map_path, note_map_path

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Dense", "FactorSource", "Geometry", "Gradient", "Hadamard", "LowRank", "RowShard", "Statistics"]

Statistics = KFACStatistics | SketchStatistics


class RowShard(NamedTuple):
    """This rank's rows of a layer's gradient-side tensor when the layer's rows lie on several
    ranks of the state's group (a routed expert's rows of a 3-D weight that FSDP2 shards by
    expert: all of them on one rank, none on the others): the refresh reduces the factor over
    the group, as for a dim-0 sharded DTensor."""

    local: torch.Tensor


# A layer's factor source for the gradient-side geometries: weight FQN -> tensor, its rows on this
# rank (`RowShard`), or None (skip).
FactorSource = Callable[[str], "torch.Tensor | RowShard | None"]

_MAX_HADAMARD_BLOCK = 1024
# the maps' default arithmetic (`GiftConfig.map_precision`): the fixed-order fp32 map everywhere
EXACT = MapPrecision.EXACT
# The least fraction of a gradient a low-rank map may keep along any direction (`LowRank.fp32_problem`):
# 2^-16 keeps 8 of fp32's 24 bits of the coefficient stored next to -1. The default damping
# (1e-3) stays far above it: a top eigenvalue is at most d_in times the mean one, so its
# coefficients stay above 2^-12 on layers of up to 16k inputs.
MIN_WEAKEST = 2.0 ** -16


def hadamard_block(d_in: int) -> int:
    """Largest power of two dividing `d_in` (capped): the butterfly's block length."""
    return min(d_in & -d_in, _MAX_HADAMARD_BLOCK)


# Eager (untraced) CPU calls expand the low-rank term over row blocks of about this many
# elements (512 KiB of fp32), so each block's r multiply-adds run in cache rather than as r
# full-size passes (measured fastest of 2^14..2^17 at a 1280 x 3456 gradient).
EAGER_BLOCK_ELEMENTS = 1 << 17


def _traced(t: torch.Tensor) -> bool:
    """Whether `t` flows through a tracer (dynamo, or make_fx as in the FX pass) rather than
    through eager kernels: traced code must stay one whole-tensor expression for Inductor."""
    return torch.compiler.is_compiling() or is_fake(t) or get_proxy_mode() is not None


def _low_rank_sum(p: torch.Tensor, c: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`sum_k (p[:, k] c[k]) basis[k]` for `p` `[rows, r]`, `basis` `[r, d_in]`, as a chain of
    r multiply-adds in a fixed order.

    Spelled elementwise on purpose: Inductor inlines the chain into the kernel that consumes
    it (the scale amax and the quantizer on the send side, the output write on the receive
    side), so the `[rows, d_in]` product of a rank-r matmul is never written to memory; the
    short loop over r runs in registers. With fp-contract off (Inductor's CPU default), eager
    kernels round every multiply and add exactly as the generated code does, so compiled and
    eager results are bit-identical.
    """
    pc = p * c
    acc = pc[:, :1] * basis[0]
    for k in range(1, basis.shape[0]):
        acc = acc + pc[:, k:k + 1] * basis[k]
    return acc


def _map_path(precision: str, t: torch.Tensor) -> MapPath:
    """`map_path` of `precision` for `t`'s device; noted (logged once) unless Dynamo is tracing."""
    if torch.compiler.is_compiling():
        return map_path(precision, t.device)
    return note_map_path(precision, t.device)


def _rows(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`fn(x, p)` on `[rows, d_in]` / `[rows, r]`; eager CPU calls run it over row blocks (the
    same elementwise arithmetic per element, hence the same bits, with a cache-sized working
    set), traced calls and accelerators on the whole tensor."""
    step = max(1, EAGER_BLOCK_ELEMENTS // max(1, x.shape[-1]))
    if x.shape[0] <= step or x.device.type != "cpu" or _traced(x):
        return fn(x, p)
    return torch.cat([fn(x[i:i + step], p[i:i + step]) for i in range(0, x.shape[0], step)])


class Geometry:
    """The Euclidean geometry (`none`, map `identity`) and the interface of every geometry.

    Class attributes are static facts about the geometry (they fix graphs and allocations);
    an instance holds one layer's map tensors. Subclasses override what differs.
    """

    name: ClassVar[str] = "none"  # the GiftConfig.geometry value
    kind: ClassVar[str] = "identity"  # the map a plan carries (shared by geometries with the same map)
    is_identity: ClassVar[bool] = True  # no map at all: nothing to select, nothing to measure
    adaptive: ClassVar[bool] = False  # whether a refresh rebuilds the map from statistics
    uses_gradient_factor: ClassVar[bool] = False  # refreshed from a gradient-side factor (no input hooks)
    needs_optimizer: ClassVar[bool] = False  # the factor lives in the optimizer's state
    # the map's coordinates are the ones the optimizer's update sees, so the error measured
    # there (`select_metric="whitened"`) is the error of the update itself
    optimizer_coordinates: ClassVar[bool] = False

    def __init__(self, d_in: int, rank: int = 32, *, seed: int = 0, device: torch.device | str = "cpu"):
        self.d_in = d_in
        self.rank = min(rank, d_in)
        self.tensors: tuple[torch.Tensor, ...] = self._allocate(seed, dict(dtype=torch.float32, device=device))

    def _allocate(self, seed: int, f32: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The map's tensors at their final shapes (the identity map has none)."""
        return ()

    # ---- the traced map ------------------------------------------------------------------
    @staticmethod
    def apply_forward(g: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        """`G T^T` for a gradient `g` of shape `[..., d_in]` (fp32). `precision`
        (`GiftConfig.map_precision`) is the arithmetic of the low-rank maps' matmuls
        (`LowRank`); the other maps have one arithmetic and ignore it."""
        return g

    @staticmethod
    def apply_inverse(gt: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        """`G~ T^{-T}`: exact inverse of `apply_forward` (up to fp32 rounding)."""
        return gt

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return self.apply_forward(g, self.tensors)

    def inverse(self, gt: torch.Tensor) -> torch.Tensor:
        return self.apply_inverse(gt, self.tensors)

    # ---- selection switches --------------------------------------------------------------
    @staticmethod
    def gated(tensors: tuple[torch.Tensor, ...], on: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The map's tensors where the 0-d bool `on` is true, the identity's values where it is
        false: a traced graph reads a layer's selection as this data (issue 31), so a change of
        selection is no guard and no recompile. Exact: where `on` holds, every tensor is the
        input's own bits (`torch.where`, no arithmetic); where it does not, the map computes
        the identity up to the sign of zeros."""
        return tensors

    @torch.no_grad()
    def set_identity(self) -> None:
        """Make the map the identity while keeping the graph (used to deselect a layer)."""

    @torch.no_grad()
    def activate(self) -> None:
        """Undo `set_identity` for a fixed map (adaptive maps are rebuilt by `refresh_from`)."""

    def fp32_problem(self) -> str | None:
        """Why the map's finite tensors still cannot carry a gradient in fp32, or None.

        A refresh checks this after the tensors' finiteness (`RefreshEngine._build_map`) and
        retries a larger damping when it names a problem: a damping so small that the map is
        singular in fp32 would otherwise turn every gradient into rounding noise times the
        inverse's gain, and the collectives would blame the gradients (NaN/Inf once the
        weights blew up). None here: the identity and the orthonormal map keep every
        direction, and the dense and diagonal maps (one matmul or one scale, no coefficient
        stored next to -1) are judged by their tensors' finiteness alone."""
        return None

    # ---- statistics and refresh ----------------------------------------------------------
    @classmethod
    def make_statistics(cls, settings: StatisticsSettings, d_in: int, device: torch.device | str) -> Statistics | None:
        """The input-statistics object the layer's forward hook feeds (None: no hook)."""
        return None

    @classmethod
    def allocate_factor(cls, d_in: int, device: torch.device | str) -> torch.Tensor | None:
        """The gradient-side factor kept between refreshes (None when the geometry has none)."""
        return torch.zeros(d_in, d_in, device=device) if cls.uses_gradient_factor else None

    @staticmethod
    @torch.no_grad()
    def reduce_factor(local: torch.Tensor, group: dist.ProcessGroup | None, sharded: bool) -> torch.Tensor:
        """A refresh's gradient-side factor from the rank's (local shard of the) source tensor,
        the same on every rank: here `R = G^T G / out`, summed over `group` when `sharded`."""
        return gradient_factor(local, group, sharded=sharded)

    @staticmethod
    @torch.no_grad()
    def fold_factor(kept: torch.Tensor, new: torch.Tensor, ema: float) -> None:
        """Fold a refresh's gradient factor into the kept one: an EMA (the first one copied)."""
        if float(kept.abs().sum()) == 0.0:
            kept.copy_(new)
        else:
            kept.mul_(ema).add_(new, alpha=1 - ema)

    @classmethod
    def factor_source(cls, weights: Callable[[str], torch.Tensor], optimizer: Any | None,
                      steps: Callable[[], int]) -> FactorSource:
        """Where a refresh reads each layer's gradient-side tensor: the reduced `.grad` of its
        weight (`weights(name)` is the weight parameter)."""
        return lambda name: weights(name).grad

    @torch.no_grad()
    def refresh_from(self, a: torch.Tensor, damping: float) -> None:
        """Recompute the whitening of the SPD factor `a` (`[d_in, d_in]`) in place (fixed maps:
        nothing to do)."""

    @torch.no_grad()
    def refresh_from_stats(self, stats: Statistics, damping: float) -> None:
        """Recompute the whitening in place from a layer's consolidated statistics object.

        `KFACStatistics` hands over its dense factor (`refresh_from`); `SketchStatistics` holds
        none, and only a map that can be built from a sketch accepts it.
        """
        if isinstance(stats, SketchStatistics):
            self._refresh_from_sketch(stats, damping)
        else:
            self.refresh_from(stats.factor, damping)

    def _refresh_from_sketch(self, stats: SketchStatistics, damping: float) -> None:
        """Fixed maps have nothing to refresh from a sketch either."""

    # ---- cost ----------------------------------------------------------------------------
    @classmethod
    def transform_flops(cls, rows: int, d_in: int, rank: int) -> float:
        """FLOPs of forward plus inverse map of a `[rows, d_in]` gradient."""
        return 0.0

    @classmethod
    def refresh_flops(cls, rows: int, d_in: int, rank: int, stats: Statistics | None) -> float:
        """FLOPs of one refresh of a `[rows, d_in]` weight's map from `stats` (the layer's
        statistics object, None where the geometry has none), for cost models: fixed maps
        rebuild nothing."""
        return 0.0

    @staticmethod
    def rank_of(tensors: tuple[torch.Tensor, ...]) -> int:
        """The rank a map's tensors were allocated with (0 for full-rank and fixed maps)."""
        return 0

    def memory_bytes(self) -> int:
        """Bytes of the map's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # ---- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"t{i}": t for i, t in enumerate(self.tensors)}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for i, t in enumerate(self.tensors):
            t.copy_(sd[f"t{i}"])


class Hadamard(Geometry):
    """Random signs, then an orthonormal block Walsh-Hadamard butterfly: fixed, always on
    while selected; the 0-d `gate` switches it off by data."""

    name, kind, is_identity = "hadamard", "hadamard", False

    def _allocate(self, seed: int, f32: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (self.d_in,), generator=gen).float() * 2 - 1
        return (signs.to(**f32), torch.ones((), **f32))

    @staticmethod
    def apply_forward(g: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        signs, gate = tensors
        return torch.where(gate > 0, fwht(g * signs, hadamard_block(g.shape[-1])), g)

    @staticmethod
    def apply_inverse(gt: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        signs, gate = tensors
        return torch.where(gate > 0, fwht(gt, hadamard_block(gt.shape[-1])) * signs, gt)

    @staticmethod
    def gated(tensors: tuple[torch.Tensor, ...], on: torch.Tensor) -> tuple[torch.Tensor, ...]:
        signs, gate = tensors
        return signs, torch.where(on, gate, 0.0)

    @torch.no_grad()
    def set_identity(self) -> None:
        self.tensors[1].zero_()

    @torch.no_grad()
    def activate(self) -> None:
        self.tensors[1].fill_(1.0)

    @classmethod
    def transform_flops(cls, rows: int, d_in: int, rank: int) -> float:
        block = d_in & -d_in
        return 2 * rows * d_in * max(1, block.bit_length() - 1)


class Dense(Geometry):
    """Dense K-FAC whitening `T = L^{-1}` from the exact input factor (input hooks)."""

    name, kind, is_identity, adaptive = "dense", "dense", False, True

    def _allocate(self, seed: int, f32: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        eye = torch.eye(self.d_in, **f32)
        return (eye, eye.clone())

    @staticmethod
    def apply_forward(g: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        tt, _ = tensors
        return g @ tt

    @staticmethod
    def apply_inverse(gt: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        _, tinv = tensors
        return gt @ tinv

    @staticmethod
    def gated(tensors: tuple[torch.Tensor, ...], on: torch.Tensor) -> tuple[torch.Tensor, ...]:
        eye = torch.eye(tensors[0].shape[0], dtype=tensors[0].dtype, device=tensors[0].device)
        return tuple(torch.where(on, t, eye) for t in tensors)

    @torch.no_grad()
    def set_identity(self) -> None:
        for t in self.tensors:
            t.copy_(torch.eye(self.d_in))

    @classmethod
    def make_statistics(cls, settings: StatisticsSettings, d_in: int, device: torch.device | str) -> Statistics | None:
        return KFACStatistics(d_in, ema=settings.ema, max_tokens=settings.max_tokens, device=device)

    @torch.no_grad()
    def refresh_from(self, a: torch.Tensor, damping: float) -> None:
        tt, tinv = dense_whitening(a, damping)
        self.tensors[0].copy_(tt)
        self.tensors[1].copy_(tinv)

    def _refresh_from_sketch(self, stats: SketchStatistics, damping: float) -> None:
        raise ValueError("a dense transform needs the exact factor (KFACStatistics), not a SketchStatistics")

    @classmethod
    def transform_flops(cls, rows: int, d_in: int, rank: int) -> float:
        return 2 * 2.0 * rows * d_in * d_in

    @classmethod
    def refresh_flops(cls, rows: int, d_in: int, rank: int, stats: Statistics | None) -> float:
        """Cholesky of the damped factor plus its triangular inverse: n^3/3 each."""
        return 2.0 / 3.0 * d_in ** 3


class LowRank(Geometry):
    """Rank-r K-FAC whitening from the input factor (input hooks; sketched by default)."""

    name, kind, is_identity, adaptive = "lowrank", "lowrank", False, True

    def _allocate(self, seed: int, f32: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        d_in, r = self.d_in, self.rank
        return (torch.ones(d_in, **f32), torch.zeros(d_in, r, **f32), torch.zeros(r, **f32), torch.zeros(r, **f32),
                torch.ones(d_in, **f32))

    @staticmethod
    def apply_forward(g: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        """`G D^{-1/2} M = G D^{-1/2} + (G U) C V^T` with `U = D^{-1/2} V` and
        `C = (I+S^2)^{-1/2} - I`. The projection `P = G U` is one skinny matmul (it reads `G`
        once and writes `[rows, r]`); the expansion uses `V^T = U^T D^{1/2}` so that the matmul's
        operand `U^T` (which Inductor materialises contiguously, `[r, d_in]`) is also the
        expansion's basis, read as contiguous rows: `G D^{-1/2} + (sum_k P_k C_k U^T_k) D^{1/2}`.
        With `precision` "exact" (the CPU's path) the expansion is `_low_rank_sum`'s fixed-order
        chain; with tensor cores on CUDA ("tf32", "bf16", "auto"), the projection and the
        expansion with its diagonal are the two kernels of `kernels.map_dispatch.lowrank_map`.
        """
        dinv, v, cf, _, dsq = tensors
        g2 = g.reshape(-1, g.shape[-1])
        path = _map_path(precision, g)
        if path.kernels:
            return lowrank_map(g2, *LowRank.forward_operands(tensors), path.precision.value).reshape(g.shape)
        ut = (v * dinv.unsqueeze(1)).t().contiguous()
        p = torch.mm(g2, ut.t())
        out = _rows(lambda x, pb: x * dinv + _low_rank_sum(pb, cf, ut) * dsq, g2, p)
        return out.reshape(g.shape)

    @staticmethod
    def forward_operands(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The forward map's kernel operands `(basis, coef, pre, post)` = `(U, C, D^{-1/2}, D^{1/2})`,
        `U = D^{-1/2} V`: what `kernels.map_dispatch.lowrank_map` takes on CUDA, and the
        exchange's fused sender (`kernels.fused_sender.encode_lowrank`) too."""
        dinv, v, cf, _, dsq = tensors
        return v * dinv.unsqueeze(1), cf, dinv, dsq

    @staticmethod
    def apply_inverse(gt: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        """`G~ M^{-1} D^{1/2} = (G~ + (G~ V) C' V^T) D^{1/2}`, `C' = (I+S^2)^{1/2} - I`;
        the matmul's operand `V^T` (materialised `[r, d_in]`) is the expansion's basis; the
        same kernels as the forward where `precision` puts it on tensor cores."""
        _, v, _, ci, dsq = tensors
        g2 = gt.reshape(-1, gt.shape[-1])
        path = _map_path(precision, gt)
        if path.kernels:
            return lowrank_map(g2, *LowRank.inverse_operands(tensors), path.precision.value).reshape(gt.shape)
        vt = v.t().contiguous()
        p = torch.mm(g2, vt.t())
        out = _rows(lambda x, pb: (x + _low_rank_sum(pb, ci, vt)) * dsq, g2, p)
        return out.reshape(gt.shape)

    @staticmethod
    def inverse_operands(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The inverse map's kernel operands `(basis, coef, pre, post)` = `(V, C', D^{1/2}, D^{1/2})`:
        what `kernels.map_dispatch.lowrank_map` takes on CUDA, and the all-reduce's fused
        receiver (`kernels.fused_receiver.decode_inverse_lowrank`) too."""
        _, v, _, ci, dsq = tensors
        return v, ci, dsq, dsq

    @staticmethod
    def gated(tensors: tuple[torch.Tensor, ...], on: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dinv, v, cf, ci, dsq = tensors
        return (torch.where(on, dinv, 1.0), torch.where(on, v, 0.0), torch.where(on, cf, 0.0),
                torch.where(on, ci, 0.0), torch.where(on, dsq, 1.0))

    @torch.no_grad()
    def set_identity(self) -> None:
        dinv, v, cf, ci, dsq = self.tensors
        dinv.fill_(1.0), v.zero_(), cf.zero_(), ci.zero_(), dsq.fill_(1.0)

    def fp32_problem(self) -> str | None:
        """The forward map scales each direction `v_k` by `1 + c_k = (1 + s_k^2)^{-1/2}`, stored
        as `c_k` next to -1: in fp32 that keeps `24 - log2(1 + s_k^2) / 2` bits, none once
        `s_k^2` passes 2^48 (the map then annihilates `v_k`, and the inverse multiplies what
        rounding left there by `(1 + s_k^2)^{1/2}`). A problem below `MIN_WEAKEST` (8 bits
        kept): the factor's top eigenvalue is then over 2^32 times its damped residual."""
        weakest = float((1.0 + self.tensors[2]).min()) if self.tensors[2].numel() else 1.0
        if weakest >= MIN_WEAKEST:
            return None
        return (f"the map is singular in fp32: along its strongest direction it keeps {weakest:.3g} of the "
                f"gradient (under {MIN_WEAKEST:g}, i.e. fewer than 8 of fp32's bits; the factor's top eigenvalue "
                "is too many times its damped residual)")

    @classmethod
    def make_statistics(cls, settings: StatisticsSettings, d_in: int, device: torch.device | str) -> Statistics | None:
        """A sketch (unless configured dense, or the layer is too narrow for the sketch to be
        smaller), else the exact factor."""
        if sketch_chosen(settings, d_in):
            return SketchStatistics(d_in, rank=settings.rank, sketch_cols=settings.sketch_cols, ema=settings.ema,
                                    max_tokens=settings.max_tokens, seed=settings.seed, device=device)
        return KFACStatistics(d_in, ema=settings.ema, max_tokens=settings.max_tokens, device=device)

    @torch.no_grad()
    def refresh_from(self, a: torch.Tensor, damping: float) -> None:
        for dst, src in zip(self.tensors, lowrank_whitening(a, self.rank, damping)):
            dst.copy_(src)

    def _refresh_from_sketch(self, stats: SketchStatistics, damping: float) -> None:
        for dst, src in zip(self.tensors, stats.whitening(self.rank, damping)):
            dst.copy_(src)

    @classmethod
    def transform_flops(cls, rows: int, d_in: int, rank: int) -> float:
        return 2 * (4.0 * rows * d_in * rank + 2.0 * rows * d_in)

    @classmethod
    def refresh_flops(cls, rows: int, d_in: int, rank: int, stats: Statistics | None) -> float:
        """Nystrom from the sketch (`SketchStatistics.whitening_flops`), or subspace iteration
        on the dense factor (`lowrank_refresh_flops`)."""
        if isinstance(stats, SketchStatistics):
            return stats.whitening_flops(rank)
        return lowrank_refresh_flops(d_in, rank)

    @staticmethod
    def rank_of(tensors: tuple[torch.Tensor, ...]) -> int:
        return tensors[1].shape[1]


class Gradient(LowRank):
    """Rank-r whitening of the gradient-side factor `R = G^T G / out` of the reduced gradient,
    folded into an EMA over refreshes (no input hooks)."""

    name = "gradient"
    uses_gradient_factor = True

    @classmethod
    def refresh_flops(cls, rows: int, d_in: int, rank: int, stats: Statistics | None) -> float:
        """The factor `G^T G` of the gradient-side tensor, then subspace iteration on it."""
        return 2.0 * rows * d_in ** 2 + lowrank_refresh_flops(d_in, rank)

    @classmethod
    def make_statistics(cls, settings: StatisticsSettings, d_in: int, device: torch.device | str) -> Statistics | None:
        return None
