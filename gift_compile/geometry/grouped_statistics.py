"""Per-expert input statistics of a grouped GEMM (MoE experts: `torch._grouped_mm` with offsets).

A grouped layer runs G experts of the same input width on one `[R, d_in]` input whose rows are
sorted by expert: expert e's tokens are rows `[offsets[e-1], offsets[e])` (torchtitan's
`offsets_E`, the cumulative token counts), and rows from `offsets[-1]` on are padding. Each
expert is whitened with its own map, so each needs its own `A_e = E[x x^T]` over its tokens.

`GroupedSketchStatistics` and `GroupedKFACStatistics` keep the G experts' statistics in stacked
tensors (a leading dim of G on every tensor of `SketchStatistics` / `KFACStatistics`), so one
traced `observe` per forward updates all of them, and hand out each expert as the per-layer
class around views of its row (`expert(e)`): `consolidate`, `whitening`, `state_dict` and the
maps' `refresh_from_stats` then work per expert unchanged.

`observe` has static shapes and no data-dependent Python: the expert of every row is
`searchsorted(offsets, row, right=True)` (G for padding), and the per-expert sums are one dense
contraction against the rows' one-hot membership, so a new token-count vector of the same R is
data, not a recompile. It costs G times the FLOPs of one layer's sketch of the same tokens (each
expert's product runs over every sampled row, masked): fine at the few local experts of an
expert-parallel rank; a `torch._grouped_mm` on the offsets would drop the factor on GPUs that run it.
"""

from __future__ import annotations

import torch

from gift_compile.geometry.statistics import (
    KFACStatistics, SketchStatistics, StatisticsSettings, _gated, kfac_state, sketch_chosen, sketch_matrix,
    sketch_state,
)

__all__ = ["GroupedKFACStatistics", "GroupedSketchStatistics", "make_grouped_statistics"]


def _expert_rows(x: torch.Tensor, offsets: torch.Tensor, groups: int,
                 max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(sub, member, seen)` of one grouped input `x` (`[R, d_in]`): the strided subsample of at
    most `max_tokens` rows (the stride `SketchStatistics.observe` takes over all R rows), fp32,
    zero on padding rows, so that huge or non-finite padding never reaches a sum (`0 * inf` is
    NaN); its rows' one-hot expert membership (`[m, G]` fp32, all zero on padding); and every
    expert's tokens in `x` (`[G]` fp32, before subsampling)."""
    n = x.shape[0]
    stride = max(1, -(-n // max_tokens))
    rows = torch.arange(0, n, stride, device=x.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets, rows, right=True)
    member = torch.nn.functional.one_hot(expert, groups + 1)[:, :groups].to(torch.float32)
    sub = torch.where(expert.unsqueeze(1) < groups, x[::stride].float(), 0.0)
    ends = offsets.clamp(min=0, max=n).to(torch.float32)
    seen = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    return sub, member, seen


def _per_expert(sub: torch.Tensor, member: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`[G, d_in, c]`: `sub_e^T right_e` for each expert e, `right` (`[m, c]`) row-aligned with
    `sub`. One matmul of `sub^T` against the right factor spread over the experts' columns
    (`[m, G c]`, zero outside each row's expert), so no `[G, m, d_in]` copy of the inputs."""
    m, c = right.shape
    # sized explicitly: a rank may get no tokens at all (m = 0), where -1 is ambiguous
    spread = (member.unsqueeze(2) * right.unsqueeze(1)).reshape(m, member.shape[1] * c)
    return (sub.t() @ spread).reshape(sub.shape[1], -1, c).permute(1, 0, 2)


def _checked_input(x: torch.Tensor, offsets: torch.Tensor, groups: int, d_in: int, who: str) -> torch.Tensor:
    """`x` detached, after checking its shape and the offsets' (static facts: no guard on data)."""
    if x.dim() != 2 or x.shape[-1] != d_in:
        raise ValueError(f"{who}.observe: input shape {tuple(x.shape)}; expected [rows, d_in={d_in}]")
    if tuple(offsets.shape) != (groups,) or offsets.is_floating_point():
        raise ValueError(f"{who}.observe: offsets must be an int tensor of shape ({groups},), got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    return x.detach()


def _accumulate(windows: list[tuple[torch.Tensor, torch.Tensor]], count: torch.Tensor, tokens: torch.Tensor,
                dropped: torch.Tensor, finite: torch.Tensor, gate: torch.Tensor | None, member: torch.Tensor,
                seen: torch.Tensor) -> None:
    """Add one observation to every expert's window, all or nothing (`finite` and `gate`, 0-d),
    and its counters as the per-layer classes count them: sampled tokens into `count` (window),
    every token seen into `tokens`, a non-finite batch into every expert's `dropped`."""
    take, drop, on = _gated(finite, gate, 1)
    for acc, new in windows:
        acc.add_(torch.where(take, new, 0.0))
    count.add_(take.to(torch.float32) * member.sum(dim=0))
    dropped.add_(drop.to(torch.int64))
    tokens.add_(on * seen)


class GroupedSketchStatistics:
    """`SketchStatistics` of `groups` experts of width `d_in`, in stacked tensors.

    `state` holds `sketch_state`'s tensors with a leading dim of G; `expert(e)` is a
    `SketchStatistics` around row e of each (views, built once). Every expert shares one
    `Omega` (same seed): `Omega` is a fixed test matrix, and each expert sketches its own
    `A_e` with it, as equally wide layers already share theirs (`sketch_matrix`).

    `observe(x, offsets, gate)`: see the module docstring for the expert of each row. A batch
    whose contribution is not finite adds nothing to any expert and counts in every expert's
    `dropped`: in the one contraction a NaN token's product reaches every expert's columns as
    `NaN * 0`, so masking the bad expert alone would need a second pass, and a non-finite input
    means the layer's activations diverged, for which dropping the batch is the conservative rule
    (`SketchStatistics` drops a layer's whole batch too).
    """

    def __init__(self, groups: int, d_in: int, *, rank: int = 32, sketch_cols: int | None = None, ema: float,
                 max_tokens: int, seed: int = 0, device: torch.device | str = "cpu"):
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"GroupedSketchStatistics: groups must be a positive int, got {groups!r}")
        self.cols = SketchStatistics.checked_cols(d_in, rank=rank, sketch_cols=sketch_cols, ema=ema,
                                                  max_tokens=max_tokens)
        self.groups, self.d_in, self.max_tokens = groups, d_in, max_tokens
        self.omega = sketch_matrix(d_in, self.cols, seed).to(device)
        self.state = sketch_state(d_in, self.cols, device, (groups,))
        self._experts = [SketchStatistics.viewing(self.omega, {k: t[e] for k, t in self.state.items()}, ema=ema,
                                                  max_tokens=max_tokens, seed=seed) for e in range(groups)]

    def expert(self, e: int) -> SketchStatistics:
        """Expert e's statistics: views of row e of `state` (and the shared `omega`)."""
        return self._experts[e]

    def observe(self, x: torch.Tensor, offsets: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """Add the grouped GEMM's input `x` (`[R, d_in]`, any float dtype) to each expert's
        window, in place; `offsets` (`[G]` int) the experts' cumulative token ends; `gate` as
        in `SketchStatistics.observe`."""
        x = _checked_input(x, offsets, self.groups, self.d_in, type(self).__name__)
        sub, member, seen = _expert_rows(x, offsets, self.groups, self.max_tokens)
        y_new = _per_expert(sub, member, sub @ self.omega)
        diag_new = member.t() @ (sub * sub)
        finite = torch.isfinite(diag_new).all() & torch.isfinite(y_new).all()
        s = self.state
        _accumulate([(s["y_acc"], y_new), (s["diag_acc"], diag_new)], s["count"], s["tokens"], s["dropped"], finite,
                    gate, member, seen)


class GroupedKFACStatistics:
    """`KFACStatistics` of `groups` experts of width `d_in` in stacked tensors (`kfac_state`
    with a leading dim of G), for experts too narrow for a sketch (`make_grouped_statistics`);
    `expert(e)` and `observe` as `GroupedSketchStatistics`'."""

    def __init__(self, groups: int, d_in: int, *, ema: float, max_tokens: int, device: torch.device | str = "cpu"):
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"GroupedKFACStatistics: groups must be a positive int, got {groups!r}")
        self.groups, self.d_in, self.max_tokens = groups, d_in, max_tokens
        self.state = kfac_state(d_in, device, (groups,))
        self._experts = [KFACStatistics.viewing({k: t[e] for k, t in self.state.items()}, ema=ema,
                                                max_tokens=max_tokens) for e in range(groups)]

    def expert(self, e: int) -> KFACStatistics:
        """Expert e's statistics: views of row e of `state`."""
        return self._experts[e]

    def observe(self, x: torch.Tensor, offsets: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """As `GroupedSketchStatistics.observe`, adding each expert's `sub_e^T sub_e`."""
        x = _checked_input(x, offsets, self.groups, self.d_in, type(self).__name__)
        sub, member, seen = _expert_rows(x, offsets, self.groups, self.max_tokens)
        new = _per_expert(sub, member, sub)
        s = self.state
        _accumulate([(s["acc"], new)], s["count"], s["tokens"], s["dropped"], torch.isfinite(new).all(), gate,
                    member, seen)


def make_grouped_statistics(settings: StatisticsSettings, groups: int, d_in: int,
                            device: torch.device | str) -> GroupedSketchStatistics | GroupedKFACStatistics:
    """The statistics of a grouped layer's `groups` experts, each chosen as `LowRank.make_statistics`
    chooses a layer's (`sketch_chosen`): a sketch, or the exact factor where it is smaller."""
    if sketch_chosen(settings, d_in):
        return GroupedSketchStatistics(groups, d_in, rank=settings.rank, sketch_cols=settings.sketch_cols,
                                       ema=settings.ema, max_tokens=settings.max_tokens, seed=settings.seed,
                                       device=device)
    return GroupedKFACStatistics(groups, d_in, ema=settings.ema, max_tokens=settings.max_tokens, device=device)
