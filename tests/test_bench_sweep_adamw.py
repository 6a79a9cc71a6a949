"""The fidelity sweep's AdamW pieces (`bench.fidelity.sweep`): the update metric against
torch's AdamW, and the prototype codecs doing what they claim."""

from __future__ import annotations

import torch

from bench.fidelity.sweep import ADAM_BETAS, AdamCodec, adamw_update
from bench.lib.reference import LayerSample
from gift_compile.config import GiftConfig


def _adamw_state(shape: tuple[int, int], steps: int = 5) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(shape))
    opt = torch.optim.AdamW([w], lr=1.0, betas=ADAM_BETAS, weight_decay=0.0)
    for _ in range(steps):  # gradients with a row x column scale structure, like real ones
        w.grad = torch.randn(shape, generator=gen) * torch.logspace(-2, 0, shape[0])[:, None]
        opt.step()
    return w, opt


def _sample(g: torch.Tensor) -> LayerSample:
    eye = torch.eye(g.shape[1])
    return LayerSample("layers.0.feed_forward.w2.weight", 1, g, None, eye, eye, eye)


def test_adamw_update_is_torchs_next_step() -> None:
    w, opt = _adamw_state((32, 64))
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    st = {k: v.clone() for k, v in opt.state[w].items()}
    expected = adamw_update(g, st, clip=0.5)
    before = w.detach().clone()
    w.grad = g * 0.5  # clip_grad_norm_ scales the gradient before the step
    opt.step()
    torch.testing.assert_close(before - w.detach(), expected.float(), rtol=1e-5, atol=1e-6)


def test_side_channel_carries_the_momentum_subspace() -> None:
    w, opt = _adamw_state((32, 64))
    st = opt.state[w]
    basis = torch.linalg.svd(st["exp_avg"].double(), full_matrices=False).Vh[:8]
    g = (torch.randn(32, 8, generator=torch.Generator().manual_seed(2)).double() @ basis).float()  # inside span(V)
    config = GiftConfig(format="int2", block_size=32)
    side, plain = AdamCodec("side-r8", _sample(g), st, 1e-3), AdamCodec("vfull-p1", _sample(g), st, 1e-3)
    assert side.extra_bits == 16.0 * 8 / 64 and plain.extra_bits == 0.0
    err_side = float((side.round_trip(g, 0, config) - g).norm() / g.norm())
    err_int2 = float((plain.round_trip(g, 0, config) - g).norm() / g.norm())
    assert err_side < 1e-2 < 0.1 < err_int2  # bf16 rounding of the projection only vs int2's error


def test_vfac_scaling_is_undone_and_hadamard_signs_differ_per_rank() -> None:
    w, opt = _adamw_state((32, 64))
    st = opt.state[w]
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    lossless = GiftConfig(format="fp32")
    for label in ("vfac-p1", "vfac-p0.5", "vcol-p1", "hadamard-rank"):
        codec = AdamCodec(label, _sample(g), st, 1e-3)
        for rank in (0, 1):
            torch.testing.assert_close(codec.round_trip(g, rank, lossless).float(), g, rtol=1e-5, atol=1e-6)
    fac = AdamCodec("vfac-p1", _sample(g), st, 1e-3).scale
    r, c = st["exp_avg_sq"].double().sum(1), st["exp_avg_sq"].double().sum(0)
    ratio = fac * torch.outer(r, c).sqrt()  # vhat^(-1/2) up to one constant
    assert float(ratio.max() / ratio.min()) < 1 + 1e-9
    col = AdamCodec("vcol-p1", _sample(g), st, 1e-3).scale
    assert torch.equal(col[0], col[-1]) and float(col[0].max() / col[0].min()) > 1.5  # one scale per column
    had = AdamCodec("hadamard-rank", _sample(g), st, 1e-3).maps
    assert not torch.equal(had[0].forward(g), had[1].forward(g))
