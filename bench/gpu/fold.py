"""The low-rank map's projection folded into the weight-gradient matmul: `bench.gpu.check`'s fold section.

The map's forward starts with the projection `P = G U` (`LowRank.apply_forward`: `G` the layer's
weight gradient `[out, d_in]`, `U = D^{-1/2} V` `[d_in, r]`), which reads `G` once more after the
backward wrote it. `G = dY^T X` (`dY` `[T, out]` the layer's output gradient, `X` `[T, d_in]` its
input, over T tokens), so `P = dY^T (X U)`: two skinny matmuls from tensors the backward already
holds, and the sender would not read `G` for its projection (the expansion still reads `G`).

Whether that wins is a question of bytes and of skinny-matmul efficiency, both the device's. The
bytes each way (bf16 activations, fp32 gradient as GIFT receives it):

    project: read G (4 out d_in) + U (4 d_in r), write P (4 out r)
    fold:    read X (2 T d_in) + U (2 d_in r), write XU (2 T r); read dY (2 T out) + XU, write P (4 out r)

so folding reads fewer bytes only when `T (d_in + out) < 2 out d_in`, i.e. with fewer tokens per
rank than the harmonic mean of `out` and `d_in` (`fold_reads_fewer`; Llama-3-8B's w2: 6371). Its rounding also
differs: `X U` has bf16 operands (the activations' dtype), so `P` is not the fp32 projection
(`rel_error` against the projection computed in fp64 from the same `G`).

The section times, per layer shape and token count, the backward's own dW matmul (`dY^T X` in
bf16, cast to the fp32 GIFT reduces: for scale), the projection of the fp32 `G`, and the fold's
two matmuls (CUDA events on a GPU; the host clock in the CPU dry run, where the times say
nothing about a GPU). Keeping the fold is decided per row from the times (`fold_wins`); on the
CPU no decision is drawn. Nothing in GIFT's path folds today: issue 26 asks to keep it only if
it wins, which a GPU run of this section settles.
"""

from __future__ import annotations

import torch

from bench.gpu.timing import median_time

__all__ = ["fold_bytes", "fold_section"]


def fold_bytes(out: int, d_in: int, tokens: int, rank: int) -> dict[str, int]:
    """Bytes each way reads and writes at least (the module docstring's formulas)."""
    return {"project": 4 * out * d_in + 4 * d_in * rank + 4 * out * rank,
            "fold": 2 * tokens * d_in + 2 * d_in * rank + 2 * tokens * rank
            + 2 * tokens * out + 2 * tokens * rank + 4 * out * rank}


def fold_section(device: torch.device, shapes: tuple[tuple[str, int, int], ...], rank: int,
                 token_counts: tuple[int, ...]) -> list[dict[str, object]]:
    """One row per layer shape (label, out, d_in) and token count: the three times, both byte
    counts, each projection's relative error against fp64, and (on CUDA) whether folding won."""
    rows = []
    gen = torch.Generator(device).manual_seed(5)
    for label, out, d_in in shapes:
        u = torch.randn(d_in, rank, device=device, generator=gen) / d_in ** 0.5
        u16 = u.bfloat16()
        for tokens in token_counts:
            dy = torch.randn(tokens, out, device=device, generator=gen).bfloat16()
            x = torch.randn(tokens, d_in, device=device, generator=gen).bfloat16()
            with torch.no_grad():
                g = torch.mm(dy.t(), x).float()
                exact = g.double() @ u.double()
                project = torch.mm(g, u)
                fold = torch.mm(dy.t(), torch.mm(x, u16)).float()
                times = {"dw_us": median_time(lambda: torch.mm(dy.t(), x).float(), device),
                         "project_us": median_time(lambda: torch.mm(g, u), device),
                         "fold_us": median_time(lambda: torch.mm(dy.t(), torch.mm(x, u16)), device)}
            moved = fold_bytes(out, d_in, tokens, rank)
            rows.append({
                "shape": label, "out": out, "d_in": d_in, "tokens": tokens, "rank": rank,
                **{k: v * 1e6 for k, v in times.items()},
                "project_bytes": moved["project"], "fold_bytes": moved["fold"],
                "fold_reads_fewer": moved["fold"] < moved["project"],
                "project_rel_error": float((project.double() - exact).norm() / exact.norm()),
                "fold_rel_error": float((fold.double() - exact).norm() / exact.norm()),
                "fold_wins": (times["fold_us"] < times["project_us"]) if device.type == "cuda" else None,
            })
    return rows
