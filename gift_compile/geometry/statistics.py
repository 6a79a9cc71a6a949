"""Streaming input statistics of a managed layer: the exact K-FAC factor, or a sketch of it.

A layer's whitening is rebuilt from `A = E[x x^T]` of its inputs. Two ways to keep it:

- `KFACStatistics`: the dense factor (a window accumulator and an EMA, 2 d_in^2 fp32 per
  layer). Exact, and the only option for the `dense` transform, but it does not scale:
  ~5.6 GB per rank at Llama-600M shapes, ~79 GB at Llama-3-8B shapes. Meant for small layers.
- `SketchStatistics`: only what the `lowrank` whitening needs, a randomized range sketch
  `Y = A Omega` (d_in x k, k ~ 2 x rank) plus the exact diagonal of `A`, O(d_in k) memory.
  `whitening` recovers the top eigenpairs from `Y` by a single-pass Nystrom approximation
  and takes the residual diagonal from the exact one, so the map has the same form
  (`A ~= U L U^T + D`) as `whitening.lowrank_whitening` of the exact factor.

Both update in place inside the compiled forward (`observe`) and average over the
data-parallel group eagerly at a refresh (`consolidate`).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gift_compile.config import StatisticsKind
from gift_compile.geometry.whitening import lowrank_tensors
from gift_compile.sync import all_reduce_, group_rank, reduce_, world_size

__all__ = ["KFACStatistics", "SketchStatistics", "StatisticsSettings", "kfac_state", "sketch_chosen", "sketch_matrix",
           "sketch_state"]

logger = logging.getLogger("gift_compile")

_EPS32 = torch.finfo(torch.float32).eps
_TINY32 = torch.finfo(torch.float32).tiny
# `SketchStatistics.holder` when every rank holds the consolidated sketch (all-reduce mode).
_EVERY_RANK = -1


@dataclass(frozen=True)
class StatisticsSettings:
    """What a geometry builds a layer's statistics from (`Geometry.make_statistics`): resolved
    once per state from its `GiftConfig` (`gift_compile.runtime.state.layer_spec`), so the
    geometry layer never reads the config. `kind` chooses the sketch where it is smaller than
    the exact factor; `sketch_cols` is the sketch's k (the config's 0 already resolved to
    2 x `rank`)."""

    kind: StatisticsKind
    rank: int
    sketch_cols: int
    ema: float
    max_tokens: int
    seed: int


def sketch_chosen(settings: StatisticsSettings, d_in: int) -> bool:
    """Whether a layer (or each expert of a grouped one) of `d_in` inputs keeps a sketch rather
    than the exact factor: configured so, and the sketch is the smaller of the two."""
    return settings.kind is StatisticsKind.SKETCH and 2 * d_in > 3 * settings.sketch_cols


def kfac_state(d_in: int, device: torch.device | str, lead: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """`KFACStatistics`' tensors, zero, each with the leading dims `lead` (`(G,)`: stacked for
    G experts, `geometry.grouped_statistics`)."""
    f32 = dict(dtype=torch.float32, device=device)
    return {"acc": torch.zeros(*lead, d_in, d_in, **f32), "count": torch.zeros(lead, **f32),
            "tokens": torch.zeros(lead, **f32), "factor": torch.zeros(*lead, d_in, d_in, **f32),
            "initialized": torch.zeros(lead, dtype=torch.bool, device=device),
            "dropped": torch.zeros(lead, dtype=torch.int64, device=device)}


def sketch_state(d_in: int, cols: int, device: torch.device | str,
                 lead: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """`SketchStatistics`' persistent tensors (`_persistent`'s keys), initial values, each with
    the leading dims `lead`, as `kfac_state`."""
    f32 = dict(dtype=torch.float32, device=device)
    return {"y_acc": torch.zeros(*lead, d_in, cols, **f32), "diag_acc": torch.zeros(*lead, d_in, **f32),
            "count": torch.zeros(lead, **f32), "tokens": torch.zeros(lead, **f32),
            "dropped": torch.zeros(lead, dtype=torch.int64, device=device),
            "y": torch.zeros(*lead, d_in, cols, **f32), "diag": torch.zeros(*lead, d_in, **f32),
            "initialized": torch.zeros(lead, dtype=torch.bool, device=device),
            "holder": torch.full(lead, _EVERY_RANK, dtype=torch.int64, device=device)}


def _gated(finite: torch.Tensor, gate: torch.Tensor | None,
           n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """`(take, drop, tokens)` of one observation: whether its contribution enters the window,
    whether it counts as dropped (non-finite), and the tokens it adds; all masked by `gate`."""
    if gate is None:
        return finite, ~finite, n
    return finite & gate, ~finite & gate, gate.to(torch.float32) * n


class KFACStatistics:
    """Running K-FAC input factor `A = E[x x^T]` of one linear layer.

    `observe(x)` runs inside the (compiled) forward every training step on a strided subsample
    of at most `max_tokens` tokens and accumulates into tensors in place; `consolidate` runs
    eagerly at a refresh: it averages the accumulator over the data-parallel group (so every
    rank ends with the same `A`) and folds it into the EMA.
    """

    def __init__(self, d_in: int, *, ema: float, max_tokens: int, device: torch.device | str = "cpu"):
        self._bind(kfac_state(d_in, device), ema, max_tokens)

    @classmethod
    def viewing(cls, state: dict[str, torch.Tensor], *, ema: float, max_tokens: int) -> KFACStatistics:
        """The statistics kept in `state` (`kfac_state`'s keys and shapes), not copied: a grouped
        layer's expert sees its row of the stacked tensors through every method of this class."""
        stats = cls.__new__(cls)
        stats._bind(state, ema, max_tokens)
        return stats

    def _bind(self, state: dict[str, torch.Tensor], ema: float, max_tokens: int) -> None:
        self.ema = ema
        self.max_tokens = max_tokens
        self.acc, self.count, self.tokens = state["acc"], state["count"], state["tokens"]
        self.factor, self.initialized, self.dropped = state["factor"], state["initialized"], state["dropped"]

    def observe(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """Add one forward's inputs to the window; a batch with NaN/Inf adds nothing and is
        counted in `dropped` (one non-finite batch must not poison the running average).
        `gate` (bool, 0-d) masks the whole update: a traced forward gates with a tensor
        instead of branching on a Python flag (`routing.observe_inputs`)."""
        x2 = x.detach().reshape(-1, x.shape[-1])
        n = x2.shape[0]
        stride = max(1, -(-n // self.max_tokens))
        sub = x2[::stride].float()
        new = sub.t() @ sub
        finite = torch.isfinite(new.diagonal()).all() & torch.isfinite(new).all()
        take, drop, tokens = _gated(finite, gate, n)
        self.acc.add_(torch.where(take, new, 0.0))
        self.count.add_(take.to(torch.float32) * sub.shape[0])
        self.dropped.add_(drop.to(torch.int64))
        self.tokens.add_(tokens)

    @torch.no_grad()
    def consolidate(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """EMA-updated `A`, identical on all ranks of `group`; resets the accumulator."""
        acc = torch.cat([self.acc.reshape(-1), self.count.reshape(1)])
        all_reduce_(acc, group)
        count = acc[-1].clamp(min=1.0)
        new = (acc[:-1] / count).reshape_as(self.acc)
        if bool(acc[-1] > 0) and not bool(torch.isfinite(new).all()):
            logger.warning("GIFT: K-FAC window sum overflowed (%d tokens); window left out of the EMA", int(acc[-1]))
        elif bool(acc[-1] > 0):
            if bool(self.initialized):
                self.factor.mul_(self.ema).add_(new, alpha=1.0 - self.ema)
            else:
                self.factor.copy_(new)
                self.initialized.fill_(True)
        self.acc.zero_()
        self.count.zero_()
        return self.factor

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"acc": self.acc, "count": self.count, "tokens": self.tokens, "factor": self.factor,
                "initialized": self.initialized, "dropped": self.dropped}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, t in self.state_dict().items():
            t.copy_(sd[k])


def sketch_matrix(d_in: int, cols: int, seed: int) -> torch.Tensor:
    """The test matrix `Omega` (`[d_in, cols]`, orthonormal columns, fp32, CPU).

    A function of `(seed, d_in, cols)` only, drawn with a CPU `torch.Generator` in fp64, so
    every rank and every restart builds the same matrix without communicating (layers of
    equal width share it, which is harmless: each sketches its own `A`). The columns are
    orthonormalized because Nystrom's result does not depend on the basis of `Omega`'s range,
    while `Omega^T Omega = I` makes the stabilizing shift in `SketchStatistics.whitening` a
    plain multiple of the identity.
    """
    return _orthonormal_test_matrix(d_in, cols, seed).clone()


@functools.lru_cache(maxsize=64)
def _orthonormal_test_matrix(d_in: int, cols: int, seed: int) -> torch.Tensor:
    """`sketch_matrix`'s draw and QR, once per `(d_in, cols, seed)`: a model has a handful of
    distinct input widths but hundreds of layers (an 8B Llama: 224 managed layers, 2 widths),
    and the fp64 QR of a `[14336, 64]` draw costs ~0.1 s. Callers get a copy."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + d_in) % (1 << 63))
    q, _ = torch.linalg.qr(torch.randn(d_in, cols, generator=gen, dtype=torch.float64))
    return q.float()


class SketchStatistics:
    """Sketch `Y = A Omega`, exact `diag(A)` and token count of one layer's inputs; O(d_in k).

    `A = E[x x^T]` enters only through products with the fixed `Omega` (`sketch_matrix`), and
    both the sketch and the diagonal are linear in `A`, so the window average and the EMA
    are taken on them exactly as `KFACStatistics` takes them on `A`: the EMA of the sketch
    is the sketch of the EMA.

    - `observe(x)` (inside the compiled forward, static shapes, no data-dependent Python):
      a strided subsample of at most `max_tokens` tokens adds `sub^T (sub Omega)` and the
      column sums of squares to the window. A batch whose contribution is not finite
      (NaN/Inf inputs, or overflow) adds nothing and increments `dropped`, so it cannot
      poison the statistics and the next finite refresh rebuilds the map.
    - `consolidate(group, owner)` (eager, at a refresh): sums the window over the group,
      either onto every rank or onto `owner` only (the rank that rebuilds the transform),
      and folds the average into the EMA.
    - `whitening(rank, damping)`: the `lowrank` transform tensors, built from the EMA.

    Counters: `tokens` counts every token seen (dropped batches included, as the cost the
    forward paid), `count` the sampled tokens in the current window, `dropped` the batches
    left out. `dropped` and `tokens` are per rank and never communicated.

    Persistent memory (`nbytes`): `Omega`, window and EMA sketches (3 d_in k fp32) plus a few
    vectors of length d_in; `observe` costs ~4 m d_in k FLOPs for m sampled tokens
    (`observe_flops`) against 2 m d_in^2 for the dense factor.
    """

    def __init__(
        self,
        d_in: int,
        *,
        rank: int = 32,
        sketch_cols: int | None = None,
        ema: float,
        max_tokens: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ):
        cols = self.checked_cols(d_in, rank=rank, sketch_cols=sketch_cols, ema=ema, max_tokens=max_tokens)
        self._bind(sketch_matrix(d_in, cols, seed).to(device), sketch_state(d_in, cols, device), ema, max_tokens, seed)

    @staticmethod
    def checked_cols(d_in: int, *, rank: int, sketch_cols: int | None, ema: float, max_tokens: int) -> int:
        """The sketch's columns k of these constructor arguments, checked (ValueError otherwise);
        `geometry.grouped_statistics` builds its experts' from the same arguments."""
        for name, value in (("d_in", d_in), ("rank", rank), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SketchStatistics: {name} must be a positive int, got {value!r}")
        if sketch_cols is not None and (not isinstance(sketch_cols, int) or sketch_cols < 1):
            raise ValueError(f"SketchStatistics: sketch_cols must be a positive int or None, got {sketch_cols!r}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"SketchStatistics: ema must be a float in [0, 1), got {ema!r}")
        return min(sketch_cols if sketch_cols is not None else 2 * rank, d_in)

    @classmethod
    def viewing(cls, omega: torch.Tensor, state: dict[str, torch.Tensor], *, ema: float, max_tokens: int,
                seed: int) -> SketchStatistics:
        """The statistics kept in `state` (`sketch_state`'s keys and shapes) with the test matrix
        `omega` (`sketch_matrix(d_in, cols, seed)`), not copied: a grouped layer's expert sees its
        row of the stacked tensors through every method of this class (`consolidate`,
        `whitening`, `state_dict`, ...), which all update their tensors in place."""
        stats = cls.__new__(cls)
        stats._bind(omega, state, ema, max_tokens, seed)
        return stats

    def _bind(self, omega: torch.Tensor, state: dict[str, torch.Tensor], ema: float, max_tokens: int,
              seed: int) -> None:
        self.d_in, self.cols = omega.shape
        self.ema = ema
        self.max_tokens = max_tokens
        self.seed = seed
        self.omega = omega
        # the current window (per rank)
        self.y_acc, self.diag_acc, self.count = state["y_acc"], state["diag_acc"], state["count"]
        self.tokens, self.dropped = state["tokens"], state["dropped"]
        # the EMA (on the ranks that hold it, see `holder`)
        self.y, self.diag, self.initialized = state["y"], state["diag"], state["initialized"]
        # which group rank holds the EMA: every rank (all-reduce mode) or one owner; the same
        # value on every rank, so a change of owner fails on all ranks alike
        self.holder = state["holder"]

    def _persistent(self) -> dict[str, torch.Tensor]:
        return {"y_acc": self.y_acc, "diag_acc": self.diag_acc, "count": self.count, "tokens": self.tokens,
                "dropped": self.dropped, "y": self.y, "diag": self.diag, "initialized": self.initialized,
                "holder": self.holder}

    # ---- hot path ------------------------------------------------------------------------
    def observe(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """Add the inputs `x` (`[..., d_in]`) of one forward to the window, in place; `gate`
        as in `KFACStatistics.observe`.

        Finiteness is tested on the contribution, not on `x`: a NaN or Inf anywhere in the
        subsample reaches the column sums of squares (squares cannot cancel an Inf), and the
        sketch term is tested too for overflow, at O(d_in k) instead of O(m d_in).
        """
        if x.shape[-1] != self.d_in:
            raise ValueError(f"SketchStatistics.observe: input width {x.shape[-1]} != d_in {self.d_in}")
        x2 = x.detach().reshape(-1, self.d_in)
        n = x2.shape[0]
        stride = max(1, -(-n // self.max_tokens))
        sub = x2[::stride].float()
        y_new = sub.t() @ (sub @ self.omega)
        diag_new = (sub * sub).sum(dim=0)
        finite = torch.isfinite(diag_new).all() & torch.isfinite(y_new).all()
        take, drop, tokens = _gated(finite, gate, n)
        self.y_acc.add_(torch.where(take, y_new, 0.0))
        self.diag_acc.add_(torch.where(take, diag_new, 0.0))
        self.count.add_(take.to(torch.float32) * sub.shape[0])
        self.dropped.add_(drop.to(torch.int64))
        self.tokens.add_(tokens)

    def observe_flops(self, tokens: int) -> float:
        """FLOPs of one `observe` of `tokens` tokens (for cost models): the two sketch matmuls
        (4 m d_in k for m sampled tokens), the squares, and the masked accumulation."""
        stride = max(1, -(-tokens // self.max_tokens))
        m = -(-tokens // stride)
        d, k = self.d_in, self.cols
        return 4.0 * m * d * k + 2.0 * m * d + 3.0 * (d * k + d)

    # ---- refresh -------------------------------------------------------------------------
    @torch.no_grad()
    def consolidate(self, group: dist.ProcessGroup | None, owner: int | None = None) -> bool:
        """Average the window over `group`, fold it into the EMA, reset the window.

        `owner=None`: all-reduce, every rank folds and holds the same EMA. `owner=r` (a group
        rank): reduce onto `r` only, which alone folds and can call `whitening` (the others'
        reduced buffers are unspecified, and they mark their EMA as not held). Because only
        the owner keeps the EMA current, a layer's owner must stay fixed once chosen.
        Returns whether this rank now holds a consolidated sketch (`whitening` is callable).
        A window with no finite batch on any rank leaves the EMA as it was.
        """
        world = world_size(group)
        if owner is not None and not (isinstance(owner, int) and 0 <= owner < world):
            raise ValueError(f"SketchStatistics.consolidate: owner must be a group rank in [0, {world}), got {owner!r}")
        held = int(self.holder)
        if held != _EVERY_RANK and owner != held:
            raise ValueError(
                f"SketchStatistics.consolidate(owner={owner!r}): the EMA is held by group rank {held} only "
                f"(earlier consolidate(owner={held})); other ranks' copies are stale. Keep a layer's owner fixed."
            )
        d, k = self.d_in, self.cols
        buf = torch.cat([self.y_acc.reshape(-1), self.diag_acc, self.count.reshape(1)])
        if owner is None:
            all_reduce_(buf, group)
        else:
            reduce_(buf, group, owner)
        if owner is None or group_rank(group) == owner:
            self._fold(buf[: d * k].reshape(d, k), buf[d * k: d * k + d], float(buf[-1]))
        else:
            self.initialized.fill_(False)
        self.holder.fill_(_EVERY_RANK if owner is None else owner)
        self.y_acc.zero_()
        self.diag_acc.zero_()
        self.count.zero_()
        return bool(self.initialized)

    def _fold(self, y_sum: torch.Tensor, diag_sum: torch.Tensor, count: float) -> None:
        if count <= 0.0:
            return
        y_new, diag_new = y_sum / count, diag_sum / count
        if not (bool(torch.isfinite(y_new).all()) and bool(torch.isfinite(diag_new).all())):
            # every batch was finite, but their fp32 sum overflowed: the inputs have diverged
            logger.warning("GIFT: sketch window sum overflowed (%d tokens); window left out of the EMA", int(count))
            return
        if bool(self.initialized):
            self.y.mul_(self.ema).add_(y_new, alpha=1.0 - self.ema)
            self.diag.mul_(self.ema).add_(diag_new, alpha=1.0 - self.ema)
        else:
            self.y.copy_(y_new)
            self.diag.copy_(diag_new)
            self.initialized.fill_(True)

    @torch.no_grad()
    def whitening(self, rank: int, damping: float) -> tuple[torch.Tensor, ...]:
        """`(D^{-1/2}, V, (1+S^2)^{-1/2}-1, (1+S^2)^{1/2}-1, D^{1/2})`, as `lowrank_whitening`.

        Single-pass Nystrom approximation with a stabilizing shift (Tropp, Yurtsever, Udell &
        Cevher 2017): sketch `A + nu I` as `Y_nu = Y + nu Omega`, form `B = Omega^T Y_nu`
        (>= nu I, as `Omega` is orthonormal), `F = Y_nu B^{-1/2}`, and the thin SVD `F = U S W^T`
        gives `A + nu I ~= U S^2 U^T`, so the eigenvalues of `A` are `S^2 - nu`. `nu` sits at
        the fp32 rounding level of `Y` (it was accumulated in fp32); eigenvalues of `B` below
        `nu / 2` cannot come from `A + nu I` and are clamped there, which shrinks (never
        amplifies) such noise directions. The top `rank` pairs and the exact diagonal then go
        through the same residual-diagonal and damping rule as the exact path
        (`whitening.lowrank_tensors`). fp64 throughout; deterministic.
        """
        if not bool(self.initialized):
            raise RuntimeError(
                "SketchStatistics.whitening: this rank holds no consolidated sketch (nothing observed yet, "
                "or consolidate(owner=...) named another rank)"
            )
        if not (isinstance(rank, int) and 1 <= rank <= self.cols):
            raise ValueError(f"SketchStatistics.whitening: rank must be an int in [1, sketch_cols={self.cols}], got {rank!r}")
        y = self.y.double()
        omega = self.omega.double()
        nu = max(math.sqrt(self.d_in) * _EPS32 * float(torch.linalg.norm(y)), _TINY32)
        y_nu = y + nu * omega
        b = omega.t() @ y_nu
        evals, q = torch.linalg.eigh(0.5 * (b + b.t()))
        f = y_nu @ (q * evals.clamp(min=0.5 * nu).rsqrt())
        u, s, _ = torch.linalg.svd(f, full_matrices=False)
        lam = (s[:rank] ** 2 - nu).clamp(min=0.0)
        return lowrank_tensors(self.diag.double(), u[:, :rank], lam, damping)

    def whitening_flops(self, rank: int) -> float:
        """FLOPs of `whitening` (for cost models; compare `whitening.lowrank_refresh_flops`):
        `Omega^T Y`, the k x k eigendecomposition, `F`, its thin SVD, and the final rank-r SVD."""
        d, k = self.d_in, self.cols
        return 2.0 * d * k * k + 9.0 * k ** 3 + 2.0 * d * k * k + 4.0 * d * k * k + 4.0 * d * rank * rank

    # ---- bookkeeping ---------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this object keeps allocated for its lifetime (`Omega`, window, EMA, counters)."""
        return sum(t.numel() * t.element_size() for t in (self.omega, *self._persistent().values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Window, EMA and counters; `Omega` is not saved but identified by `sketch`
        (`[seed, d_in, cols]`), from which `load_state_dict` checks it would be rebuilt equal."""
        sd = dict(self._persistent())
        sd["sketch"] = torch.tensor([self.seed, self.d_in, self.cols], dtype=torch.int64)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        mine = [self.seed, self.d_in, self.cols]
        theirs = [int(v) for v in sd["sketch"]]
        if theirs != mine:
            raise ValueError(f"SketchStatistics.load_state_dict: saved sketch [seed, d_in, cols] = {theirs}, "
                             f"this one is {mine}; a sketch is only meaningful with its own Omega")
        for key, t in self._persistent().items():
            if sd[key].shape != t.shape:
                raise ValueError(f"SketchStatistics.load_state_dict: {key} has shape {tuple(sd[key].shape)}, "
                                 f"expected {tuple(t.shape)}")
            t.copy_(sd[key])
