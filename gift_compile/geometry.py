"""Geometry: the coordinates in which a layer's gradient is quantized.

A transform acts on the *input* dimension (the last dim of a `[out, in]` weight gradient),
row by row, so it commutes with FSDP's dim-0 sharding and with the sum over ranks:
`sum_r G_r T^T = (sum_r G_r) T^T` when every rank holds the same `T`.

Each transform is a `kind` (static: it fixes the graph) plus a tuple of tensors (data: they
are refreshed in place, so a compiled graph never recompiles). `apply_forward` /
`apply_inverse` are the pure functions of `(kind, tensors)` that the collectives, the FX pass
and the benchmarks all call.

Kinds:
- identity: `G~ = G`.
- hadamard: random signs then an orthonormal block Walsh-Hadamard butterfly; a 0-d `gate`
  tensor switches it off by data.
- dense: `T = L^{-1}` with `A + delta I = L L^T` (Cholesky), applied as two `d_in x d_in` matmuls.
- lowrank: `A ~= D^{1/2} (I + V S^2 V^T) D^{1/2}` (top-r eigenpairs plus the damped diagonal of
  the residual), `T = M D^{-1/2}`, `M = I + V((I+S^2)^{-1/2} - I)V^T`, applied in
  O(d_in * r) per row; `M^{-1} = I + V((I+S^2)^{1/2} - I)V^T`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from gift_compile.sync import all_reduce_

if TYPE_CHECKING:
    from gift_compile.statistics import KFACStatistics, SketchStatistics

KINDS = ("identity", "hadamard", "dense", "lowrank")
_MAX_HADAMARD_BLOCK = 1024


def hadamard_block(d_in: int) -> int:
    """Largest power of two dividing `d_in` (capped): the butterfly's block length."""
    return min(d_in & -d_in, _MAX_HADAMARD_BLOCK)


def _fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over consecutive blocks of the last dim."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block, block)
    h = 1
    while h < block:
        y = y.reshape(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(shape) * (1.0 / math.sqrt(block)))


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


def _rows(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`fn(x, p)` on `[rows, d_in]` / `[rows, r]`; eager CPU calls run it over row blocks (the
    same elementwise arithmetic per element, hence the same bits, with a cache-sized working
    set), traced calls and accelerators on the whole tensor."""
    step = max(1, EAGER_BLOCK_ELEMENTS // max(1, x.shape[-1]))
    if x.shape[0] <= step or x.device.type != "cpu" or _traced(x):
        return fn(x, p)
    return torch.cat([fn(x[i:i + step], p[i:i + step]) for i in range(0, x.shape[0], step)])


def apply_forward(kind: str, g: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`G T^T` for a gradient `g` of shape `[..., d_in]` (fp32).

    Low rank: `G D^{-1/2} M = G D^{-1/2} + (G U) C V^T` with `U = D^{-1/2} V` and
    `C = (I+S^2)^{-1/2} - I`. The projection `P = G U` is one skinny matmul (it reads `G`
    once and writes `[rows, r]`); the expansion uses `V^T = U^T D^{1/2}` so that the matmul's
    operand `U^T` (which Inductor materialises contiguously, `[r, d_in]`) is also the
    expansion's basis, read as contiguous rows: `G D^{-1/2} + (sum_k P_k C_k U^T_k) D^{1/2}`.
    """
    if kind == "identity":
        return g
    if kind == "hadamard":
        signs, gate = tensors
        return torch.where(gate > 0, _fwht(g * signs, hadamard_block(g.shape[-1])), g)
    if kind == "dense":
        tt, _ = tensors
        return g @ tt
    dinv, v, cf, _, dsq = tensors
    g2 = g.reshape(-1, g.shape[-1])
    ut = (v * dinv.unsqueeze(1)).t().contiguous()
    p = torch.mm(g2, ut.t())
    out = _rows(lambda x, pb: x * dinv + _low_rank_sum(pb, cf, ut) * dsq, g2, p)
    return out.reshape(g.shape)


def apply_inverse(kind: str, gt: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`G~ T^{-T}`: exact inverse of `apply_forward` (up to fp32 rounding).

    Low rank: `G~ M^{-1} D^{1/2} = (G~ + (G~ V) C' V^T) D^{1/2}`, `C' = (I+S^2)^{1/2} - I`;
    the matmul's operand `V^T` (materialised `[r, d_in]`) is the expansion's basis.
    """
    if kind == "identity":
        return gt
    if kind == "hadamard":
        signs, gate = tensors
        return torch.where(gate > 0, _fwht(gt, hadamard_block(gt.shape[-1])) * signs, gt)
    if kind == "dense":
        _, tinv = tensors
        return gt @ tinv
    _, v, _, ci, dsq = tensors
    g2 = gt.reshape(-1, gt.shape[-1])
    vt = v.t().contiguous()
    p = torch.mm(g2, vt.t())
    out = _rows(lambda x, pb: (x + _low_rank_sum(pb, ci, vt)) * dsq, g2, p)
    return out.reshape(gt.shape)


def _floor(a: torch.Tensor, damping: float) -> torch.Tensor:
    """Damping floor: `damping` times the mean eigenvalue (trace / n), never zero."""
    return diag_floor(torch.diagonal(a), damping)


def diag_floor(diag: torch.Tensor, damping: float) -> torch.Tensor:
    """`_floor` from the diagonal alone (the trace is all it needs), for sketched factors."""
    mean_eig = diag.mean().clamp(min=0.0)
    return (damping * mean_eig).clamp(min=torch.finfo(torch.float32).tiny)


class Transform:
    """A kind plus its tensors; `refresh_from` rewrites the tensors in place.

    The tensors are allocated once at their final shapes, so graphs that captured them stay
    valid across refreshes (no recompilation).
    """

    def __init__(self, kind: str, d_in: int, rank: int = 32, *, seed: int = 0, device: torch.device | str = "cpu"):
        if kind not in KINDS:
            raise ValueError(f"unknown transform kind {kind!r}; allowed: {', '.join(KINDS)}")
        self.kind = kind
        self.d_in = d_in
        self.rank = min(rank, d_in)
        f32 = dict(dtype=torch.float32, device=device)
        if kind == "identity":
            self.tensors: tuple[torch.Tensor, ...] = ()
        elif kind == "hadamard":
            gen = torch.Generator().manual_seed(seed)
            signs = torch.randint(0, 2, (d_in,), generator=gen).float() * 2 - 1
            self.tensors = (signs.to(**f32), torch.ones((), **f32))
        elif kind == "dense":
            eye = torch.eye(d_in, **f32)
            self.tensors = (eye, eye.clone())
        else:
            r = self.rank
            self.tensors = (
                torch.ones(d_in, **f32),
                torch.zeros(d_in, r, **f32),
                torch.zeros(r, **f32),
                torch.zeros(r, **f32),
                torch.ones(d_in, **f32),
            )

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return apply_forward(self.kind, g, self.tensors)

    def inverse(self, gt: torch.Tensor) -> torch.Tensor:
        return apply_inverse(self.kind, gt, self.tensors)

    @property
    def adaptive(self) -> bool:
        """Whether `refresh_from` has anything to do (dense/lowrank follow the statistics)."""
        return self.kind in ("dense", "lowrank")

    @torch.no_grad()
    def set_identity(self) -> None:
        """Make the map the identity while keeping the graph (used to deselect a layer)."""
        if self.kind == "dense":
            for t in self.tensors:
                t.copy_(torch.eye(self.d_in))
        elif self.kind == "lowrank":
            dinv, v, cf, ci, dsq = self.tensors
            dinv.fill_(1.0), v.zero_(), cf.zero_(), ci.zero_(), dsq.fill_(1.0)
        elif self.kind == "hadamard":
            self.tensors[1].zero_()

    @torch.no_grad()
    def activate(self) -> None:
        """Undo `set_identity` for the fixed rotation (adaptive kinds are rebuilt by `refresh_from`)."""
        if self.kind == "hadamard":
            self.tensors[1].fill_(1.0)

    @torch.no_grad()
    def refresh_from(self, a: torch.Tensor, damping: float) -> None:
        """Recompute the whitening of the SPD factor `a` (`[d_in, d_in]`) in place."""
        if self.kind == "dense":
            tt, tinv = dense_whitening(a, damping)
            self.tensors[0].copy_(tt)
            self.tensors[1].copy_(tinv)
        elif self.kind == "lowrank":
            for dst, src in zip(self.tensors, lowrank_whitening(a, self.rank, damping)):
                dst.copy_(src)

    @torch.no_grad()
    def refresh_from_stats(self, stats: KFACStatistics | SketchStatistics, damping: float) -> None:
        """Recompute the whitening in place from a layer's consolidated statistics object.

        `KFACStatistics` hands over its dense factor (`refresh_from`). `SketchStatistics`
        builds the `lowrank` tensors itself (`SketchStatistics.whitening`); it holds no dense
        factor, so a `dense` transform cannot be refreshed from it. Fixed maps (identity,
        Hadamard) have nothing to refresh from either.
        """
        from gift_compile.statistics import SketchStatistics  # imports this module

        if not isinstance(stats, SketchStatistics):
            self.refresh_from(stats.factor, damping)
        elif self.kind == "dense":
            raise ValueError("a dense transform needs the exact factor (KFACStatistics), not a SketchStatistics")
        elif self.kind == "lowrank":
            for dst, src in zip(self.tensors, stats.whitening(self.rank, damping)):
                dst.copy_(src)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"t{i}": t for i, t in enumerate(self.tensors)}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for i, t in enumerate(self.tensors):
            t.copy_(sd[f"t{i}"])


def dense_whitening(a: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(L^{-T}, L^T)` with `L L^T = A + delta I`: `G L^{-T}` whitens, `G~ L^T` maps back."""
    a64 = a.double()
    a64 = 0.5 * (a64 + a64.t())
    n = a64.shape[0]
    l = torch.linalg.cholesky(a64 + _floor(a64, damping) * torch.eye(n, dtype=a64.dtype, device=a64.device))
    linv = torch.linalg.solve_triangular(l, torch.eye(n, dtype=a64.dtype, device=a64.device), upper=False)
    return linv.t().float(), l.t().float()


# Randomized subspace iteration for the top eigenpairs (Halko, Martinsson & Tropp 2011,
# algorithm 4.4): a block of `SUBSPACE_FACTOR * rank` vectors, `SUBSPACE_ITERS` power steps.
SUBSPACE_FACTOR = 2
SUBSPACE_ITERS = 6


def top_eigenpairs(a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest `rank` eigenvalues (ascending) and eigenvectors of the symmetric `a`.

    A full `eigh` costs ~9 n^3 and dominates a refresh at LLM widths (n = 14336: minutes per
    layer); the low-rank whitening only needs the top `rank` directions. Subspace iteration
    costs ~(SUBSPACE_ITERS + 1) * 2 n^2 k matmul FLOPs (k = SUBSPACE_FACTOR * rank), ~20-40x
    less at n = 1280-3456, and captures >= 99.9% of the optimal rank-32 energy even for a
    slowly decaying (lambda_i ~ i^-0.5) spectrum. Small matrices use the exact `eigh`. The
    start block is seeded, so a refresh is reproducible.
    """
    n = a.shape[0]
    k = SUBSPACE_FACTOR * rank
    if 2 * k >= n:
        evals, evecs = torch.linalg.eigh(a)
        return evals[-rank:], evecs[:, -rank:]
    gen = torch.Generator(device=a.device).manual_seed(0)
    q = torch.randn(n, k, generator=gen, dtype=a.dtype, device=a.device)
    for _ in range(SUBSPACE_ITERS):
        q, _ = torch.linalg.qr(a @ q)
    evals, small = torch.linalg.eigh(q.t() @ a @ q)  # Rayleigh-Ritz on the captured subspace
    return evals[-rank:], (q @ small)[:, -rank:]


def lowrank_refresh_flops(n: int, rank: int) -> float:
    """FLOPs of `lowrank_whitening` at width `n` (for cost models): the eigensolver above,
    plus the thin SVD of the `n x rank` factor."""
    k = SUBSPACE_FACTOR * rank
    svd = 4.0 * n * rank * rank
    if 2 * k >= n:
        return 9.0 * n ** 3 + svd
    power = (SUBSPACE_ITERS + 1) * 2.0 * n * n * k  # A @ Q, and Q^T A Q
    qr = SUBSPACE_ITERS * 4.0 * n * k * k
    return power + qr + 9.0 * k ** 3 + 2.0 * n * k * rank + svd


def lowrank_whitening(a: torch.Tensor, rank: int, damping: float) -> tuple[torch.Tensor, ...]:
    """Tensors `(D^{-1/2}, V, (1+S^2)^{-1/2}-1, (1+S^2)^{1/2}-1, D^{1/2})` for `apply_forward`.

    Top-`rank` eigenpairs of `A` (`top_eigenpairs`) give `U L U^T`; the diagonal of the
    residual (floored by the damping) is `D`; a thin SVD of `D^{-1/2} U L^{1/2}` gives `V S`.
    """
    a64 = a.double()
    a64 = 0.5 * (a64 + a64.t())
    n = a64.shape[0]
    r = min(rank, n)
    evals, u = top_eigenpairs(a64, r)
    return lowrank_tensors(torch.diagonal(a64), u, evals, damping)


def lowrank_tensors(diag: torch.Tensor, u: torch.Tensor, evals: torch.Tensor, damping: float) -> tuple[torch.Tensor, ...]:
    """The `lowrank` tensors from `diag(A)` and (approximate) top eigenpairs `U, L` of `A`.

    Shared by the exact path (`lowrank_whitening`) and the sketched one
    (`gift_compile.statistics.SketchStatistics.whitening`), so both apply the same damping
    rule to the same decomposition `A ~= U L U^T + D`. Inputs fp64; outputs fp32.
    """
    lam = evals.clamp(min=0.0)
    d = (diag - (u * u * lam).sum(dim=1)).clamp(min=diag_floor(diag, damping))
    b = u * lam.sqrt() / d.sqrt().unsqueeze(1)
    v, s, _ = torch.linalg.svd(b, full_matrices=False)
    s2 = s * s
    return (
        d.rsqrt().float(),
        v.float(),
        (torch.rsqrt(1.0 + s2) - 1.0).float(),
        (torch.sqrt(1.0 + s2) - 1.0).float(),
        d.sqrt().float(),
    )


@torch.no_grad()
def gradient_factor(grad: torch.Tensor, group: dist.ProcessGroup | None = None, *, sharded: bool = False) -> torch.Tensor:
    """Gradient-side factor `R = G^T G / out` of a reduced gradient (no hooks needed).

    With `sharded=True` each rank holds a dim-0 shard and the partial products are summed
    over `group`, so the result is the same on every rank.
    """
    g = grad.detach().reshape(-1, grad.shape[-1]).double()
    r = g.t() @ g
    rows = torch.tensor(float(g.shape[0]), dtype=torch.float64, device=g.device)
    if sharded:
        all_reduce_(r, group)
        all_reduce_(rows, group)
    return (r / rows.clamp(min=1.0)).float()
