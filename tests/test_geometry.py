"""Whitening maps: exact inverses, whitening property, in-place refresh, statistics, residuals."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from gift_compile.config import GiftConfig
from gift_compile.geometry import maps
from gift_compile.geometry import Transform, apply_forward, apply_inverse, gradient_factor, top_eigenpairs
from gift_compile.geometry.statistics import KFACStatistics
from gift_compile.runtime.state import GiftState


def anisotropic_inputs(n: int = 4096, d: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    return (torch.randn(n, d, generator=g) * torch.logspace(0, -2.5, d)) @ q.t()


@pytest.mark.parametrize("kind", ["hadamard", "dense", "lowrank"])
def test_inverse_is_exact_to_fp32(kind):
    x = anisotropic_inputs()
    t = Transform(kind, 96, rank=16, seed=1)
    t.refresh_from(x.t() @ x / x.shape[0], damping=1e-3)
    g = torch.randn(40, 96)
    back = t.inverse(t.forward(g))
    assert float((back - g).norm() / g.norm()) < 1e-5


def test_hadamard_is_orthogonal_and_gated():
    t = Transform("hadamard", 96, seed=3)
    g = torch.randn(7, 96)
    assert torch.allclose(t.forward(g).norm(dim=1), g.norm(dim=1), rtol=1e-5)
    t.set_identity()
    assert torch.equal(t.forward(g), g) and torch.equal(t.inverse(g), g)


def test_dense_whitens_the_factor_exactly():
    x = anisotropic_inputs()
    a = x.t() @ x / x.shape[0]
    t = Transform("dense", 96)
    t.refresh_from(a, damping=1e-7)
    tt = t.forward(torch.eye(96))  # forward(I) = T^T
    assert torch.allclose(tt.t() @ a @ tt, torch.eye(96), atol=1e-3)


def test_lowrank_whitening_flattens_the_spectrum():
    # A spiked factor (what rank-r plus diagonal models): top-r eigenpairs plus the residual
    # diagonal is still an approximation, so T A T^T is not exactly I, but its condition
    # number must collapse from ~10^3 to O(1).
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(64, 8, generator=g))[0]
    a = u @ torch.diag(torch.logspace(3, 1, 8)) @ u.t() + torch.diag(torch.rand(64, generator=g) + 0.5)
    t = Transform("lowrank", 64, rank=8)
    t.refresh_from(a, damping=1e-6)
    tt = t.forward(torch.eye(64))
    ev = torch.linalg.eigvalsh(tt.t() @ a @ tt)
    ev_a = torch.linalg.eigvalsh(a)
    assert float(ev_a[-1] / ev_a[0]) > 500
    assert float(ev[-1] / ev[0]) < 5


def _lowrank(d_in: int = 96, rank: int = 8) -> Transform:
    t = Transform("lowrank", d_in, rank=rank)
    x = anisotropic_inputs(d=d_in)
    t.refresh_from(x.t() @ x / x.shape[0], damping=1e-3)
    return t


def test_lowrank_map_is_the_fp64_formula_to_fp32_rounding():
    """The fused spelling (projection through D^-1/2 V, expansion via V^T = (D^-1/2 V)^T D^1/2)
    is the map G D^-1/2 M and its inverse, to fp32 rounding."""
    t = _lowrank()
    dinv, v, cf, ci, dsq = (x.double() for x in t.tensors)
    g = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    h = g.double() * dinv
    fwd = h + ((h @ v) * cf) @ v.t()
    inv = (g.double() + ((g.double() @ v) * ci) @ v.t()) * dsq
    for got, want in ((t.forward(g), fwd), (t.inverse(g), inv)):
        assert got.dtype == torch.float32 and got.shape == g.shape
        assert float((got.double() - want).norm() / want.norm()) < 1e-6
    g3 = g.reshape(4, 10, 96)  # leading dims are rows
    assert torch.equal(t.forward(g3), t.forward(g).reshape(4, 10, 96))


def test_eager_row_blocks_and_compiled_code_agree_bitwise(monkeypatch):
    """Eager CPU calls run the expansion over row blocks; compiled code runs it whole inside
    Inductor's kernels. Same arithmetic per element, so the same bits."""
    t = _lowrank()
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    whole = (t.forward(g), t.inverse(g))
    monkeypatch.setattr(maps, "EAGER_BLOCK_ELEMENTS", 96 * 5)  # 13 blocks, the last one short
    blocked = (t.forward(g), t.inverse(g))
    compiled = torch.compile(lambda x: (apply_forward("lowrank", x, t.tensors), apply_inverse("lowrank", x, t.tensors)),
                             fullgraph=True, dynamic=False)(g)
    for a, b, c in zip(whole, blocked, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("direction", ["forward", "inverse"])
def test_compiled_lowrank_writes_no_full_size_intermediate(direction):
    """Inductor keeps the rank-r expansion inside the kernel that writes the result: the only
    `[rows, d_in]` buffer the compiled map allocates is its output (the projection is
    `[rows, r]`, the basis `[r, d_in]`)."""
    t = _lowrank()
    fn = apply_forward if direction == "forward" else apply_inverse
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    out, (code,) = run_and_get_code(torch.compile(lambda x: fn("lowrank", x, t.tensors), dynamic=False), g)
    assert torch.equal(out, fn("lowrank", g, t.tensors))
    call = code[code.index("def call"):]
    full = re.findall(r"empty_strided_cpu\(\(64, 96\)", call)
    assert len(full) == 1, call
    assert call.count("extern_kernels.mm(") == 1 and "addmm" not in call


def test_refresh_is_in_place():
    t = Transform("lowrank", 96, rank=8)
    ptrs = [p.data_ptr() for p in t.tensors]
    x = anisotropic_inputs()
    t.refresh_from(x.t() @ x, 1e-3)
    assert [p.data_ptr() for p in t.tensors] == ptrs
    assert float(t.tensors[1].abs().sum()) > 0


def test_kfac_statistics_ema_and_subsampling():
    x = anisotropic_inputs(n=512)
    s = KFACStatistics(96, ema=0.5, max_tokens=128)
    s.observe(x)
    assert float(s.count) == 128 and float(s.tokens) == 512
    a1 = s.consolidate(None).clone()
    sub = x[::4]
    assert torch.allclose(a1, sub.t() @ sub / 128, rtol=1e-4, atol=1e-6)
    s.observe(2 * x)
    a2 = s.consolidate(None)
    assert torch.allclose(a2, 0.5 * a1 + 0.5 * 4 * a1, rtol=1e-4, atol=1e-6)
    assert float(s.count) == 0


def test_gradient_factor():
    g = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    # the reference in fp64 like gradient_factor: an fp32 G^T G is itself off by ~1e-7
    # absolute, which the default atol rejected on some draws of an unseeded G
    exact = (g.double().t() @ g.double() / 32).float()
    assert torch.allclose(gradient_factor(g), exact, rtol=1e-5)


def test_residual_is_reexpressed_when_the_transform_changes():
    cfg = GiftConfig(geometry="lowrank", rank=8, error_feedback=True, refresh_every=1, select="all")
    state = GiftState(cfg, None)
    layer = state.add_layer("w", (32, 96), "cpu")
    layer.stats.observe(anisotropic_inputs(seed=1))
    state.step()  # first refresh: identity -> whitening
    layer.residual[0].copy_(torch.randn(32, 96))
    before = layer.transform.inverse(layer.residual[0]).clone()
    layer.stats.observe(anisotropic_inputs(seed=2) * 3)
    state.step()
    after = layer.transform.inverse(layer.residual[0])
    assert layer.selected
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decay", [0.5, 2.0])
def test_top_eigenpairs_match_the_exact_solver(decay):
    """Subspace iteration (used above 4x rank) finds the dominant subspace: it captures the
    optimal rank-r energy of a slowly or quickly decaying spectrum, with orthonormal vectors."""
    n, r = 600, 16
    u, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    a = (u * torch.arange(1, n + 1, dtype=torch.float64) ** -decay) @ u.t()
    evals, vecs = top_eigenpairs(a, r)
    exact_vals, exact_vecs = torch.linalg.eigh(a)
    captured = torch.trace(vecs.t() @ a @ vecs) / torch.trace(exact_vecs[:, -r:].t() @ a @ exact_vecs[:, -r:])
    assert captured > 0.999, float(captured)
    assert torch.allclose(evals[-1], exact_vals[-1], rtol=1e-9)
    assert torch.allclose(vecs.t() @ vecs, torch.eye(r, dtype=torch.float64), atol=1e-10)
    assert torch.equal(top_eigenpairs(a, r)[1], vecs)  # seeded: reproducible
