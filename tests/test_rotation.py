"""Block rotation (`GiftConfig.block_rotation`, `gift_compile.codec.rotation`): an exact
orthonormal change of the code axes inside each scale block, the same on every rank, that cuts
the error of outlier-heavy blocks and sends the same bytes."""

import pytest
import torch
import torch.distributed as dist

from gift_compile.codec import FormatSpec
from gift_compile.codec.rotation import rotate, rotation_block, unrotate
from gift_compile.config import GiftConfig, GiftConfigError
from gift_compile.exchange import collectives as C
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.selection import round_trip
from multirank import run_ranks


def _column_scaled(rows: int = 64, cols: int = 200, seed: int = 0) -> torch.Tensor:
    """Columns of very different scale, as a weight gradient's input side often has: blocks of
    32 columns then hold a few large elements and many small ones."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 0, cols)[torch.randperm(cols, generator=g)]
    return torch.randn(rows, cols, generator=g) * scale


def test_rotation_is_orthonormal_inside_each_block_and_leaves_the_ragged_end():
    x = _column_scaled(8, 70)  # two whole blocks of 32, a 6-column tail
    y = rotate(x, 32)
    assert not torch.allclose(y[:, :64], x[:, :64])
    assert torch.equal(y[:, 64:], x[:, 64:]), "columns past the last whole block must stay as they are"
    for b in (slice(0, 32), slice(32, 64)):  # each block keeps its own energy: no mixing across scales
        torch.testing.assert_close(y[:, b].norm(dim=1), x[:, b].norm(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close(unrotate(y, 32), x, rtol=0, atol=1e-6)
    assert rotation_block(24) == 8 and rotation_block(16) == 16
    with pytest.raises(ValueError, match="at least 2"):
        rotation_block(1)


def test_traced_rotation_writes_the_eager_bits():
    x = _column_scaled(16, 96)
    compiled = torch.compile(lambda t: unrotate(rotate(t, 16) * 0.5, 16), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), unrotate(rotate(x, 16) * 0.5, 16))


@pytest.mark.parametrize("fmt,block", [("int2", 32), ("int3", 32), ("int2", 16)])
def test_rotation_cuts_the_error_of_outlier_blocks(fmt, block):
    g = _column_scaled()
    spec = FormatSpec(fmt, "row", block)
    off = float((round_trip(g, spec, IDENTITY_KIND, ()) - g).norm() / g.norm())
    on = float((round_trip(g, spec, IDENTITY_KIND, (), block_rotation=True) - g).norm() / g.norm())
    assert on < 0.85 * off, (fmt, block, off, on)


def test_config_refuses_rotation_without_blocks():
    with pytest.raises(GiftConfigError, match="block_rotation.*no blocks"):
        GiftConfig(format="fp8_e4m3", scaling="row", block_rotation=True)
    GiftConfig(format="fp8_e4m3", scaling="block", block_size=24, block_rotation=True)  # rotates by 8


def _rotated_collectives(rank: int, world: int) -> dict:
    x = _column_scaled(16, 96, seed=10 + rank)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    out = {"exact": exact}
    for rot in (False, True):
        cfg = GiftConfig(format="int2", block_size=32, block_rotation=rot)
        out[f"ar/{rot}"] = C.all_reduce(x, dist.group.WORLD, cfg)
        out[f"rs/{rot}"] = C.reduce_scatter(x, dist.group.WORLD, cfg)
    return out


def test_every_rank_decodes_the_same_rotated_bits_with_a_smaller_error():
    res = run_ranks(_rotated_collectives, 2)
    exact = res[0]["exact"]
    assert torch.equal(res[0]["ar/True"], res[1]["ar/True"]), "the ranks decoded different bits"
    err = {rot: float((res[0][f"ar/{rot}"] - exact).norm() / exact.norm()) for rot in (False, True)}
    rs = {rot: float((torch.cat([res[r][f"rs/{rot}"] for r in range(2)]) - exact).norm() / exact.norm())
          for rot in (False, True)}
    assert err[True] < 0.85 * err[False] and rs[True] < 0.85 * rs[False], (err, rs)
