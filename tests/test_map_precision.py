"""`bench.fidelity.map_precision`'s emulation of the tensor-core map: the operand rounding and its error size.

The bench's numbers (what TF32 / bf16 operands do to the codec's error) are only as good as
its emulation, so: the mantissa rounding is round-to-nearest-even at the right width (bf16's
bit for bit torch's own conversion, TF32's against an fp64 restatement), and the emulated map's
error against the map in fp64 has the size the operand rounding predicts (about one half-ulp
of the precision, relative to the low-rank term), 8x apart between the two precisions, where
the exact fp32 map's is a thousand times smaller.
"""

from __future__ import annotations

import pytest
import torch

from bench.fidelity.map_emulation import emulated_map, round_mantissa
from bench.fidelity.map_precision import maps
from gift_compile.geometry.maps import LowRank


def _values(n: int = 200_000) -> torch.Tensor:
    """fp32 values over a wide range of exponents, both signs, with exact ties at 7 and 10 bits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-8), 3 * 2**-20 * (1 + 2**-11)])
    return torch.cat([x, ties, torch.zeros(1)])


def test_bf16_rounding_is_torchs_conversion() -> None:
    x = _values()
    assert torch.equal(round_mantissa(x, 7), x.bfloat16().float())


def test_tf32_rounding_is_nearest_even_at_ten_bits() -> None:
    """Against fp64: the value over its ulp at 10 bits, rounded half to even (`torch.round`)."""
    x = _values()
    xd = x.double()
    ulp = torch.exp2(torch.floor(torch.log2(xd.abs().clamp(min=1e-300))) - 10)
    want = torch.where(xd == 0, xd, torch.round(xd / ulp) * ulp)
    assert torch.equal(round_mantissa(x, 10).double(), want)
    assert round_mantissa(torch.tensor([1 + 2**-11]), 10).item() == 1.0  # a tie goes to even
    assert round_mantissa(torch.tensor([1 + 3 * 2**-11]), 10).item() == 1 + 2**-9


@pytest.mark.parametrize(("cols", "rank"), [(300, 20), (512, 32)])
def test_the_emulated_map_errs_by_the_operand_rounding(cols: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    dinv = torch.rand(cols, generator=gen) + 0.5
    v = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0].contiguous()
    cf = -0.9 * torch.rand(rank, generator=gen)
    tensors = (dinv, v, cf, 1 / (1 + cf) - 1, 1 / dinv)
    t64 = tuple(t.double() for t in tensors)
    g = torch.randn(64, cols, generator=gen)
    exact = LowRank.apply_forward(g.double(), t64)
    low = float((exact - g.double() * dinv.double()).norm())
    errors = {}
    for name, bits in (("tf32", 10), ("bf16", 7)):
        out = emulated_map(g, v * dinv.unsqueeze(1), tensors[2], dinv, tensors[4], bits)
        errors[name] = float((out.double() - exact).norm()) / low
        assert 0.25 * 2 ** -(bits + 1) < errors[name] < 2 * 2 ** -(bits + 1), (name, errors[name])
        forward, inverse = maps(tensors, name)  # the bench's pair is the map and its inverse
        back = inverse(forward(g))
        assert float((back - g).norm() / g.norm()) < 4 * 2 ** -(bits + 1)
    assert 5 < errors["bf16"] / errors["tf32"] < 12
    fp32 = float((LowRank.apply_forward(g, tensors).double() - exact).norm()) / low
    assert fp32 < errors["tf32"] / 100


def test_the_block_resolves_a_difference_only_after_the_family_wise_correction(tmp_path) -> None:
    """A change whose own CI excludes 0 (p = 0.04) is not marked resolved in a 10-comparison
    table (Holm needs p <= 0.005 for the smallest); one at p = 1e-6 is."""
    import json

    from bench.fidelity.map_precision import block

    def diff(mean: float, p: float) -> dict:
        return {"mean": mean, "std": 1.0, "n": 56, "ci95": 0.5 * abs(mean), "mde80": 0.0, "p": p, "resolved": p < 0.05}

    metric = {"exact_mean": 0.1, "tf32": {"mean": 0.1, "minus_exact": diff(1e-4, 0.5)},
              "bf16": {"mean": 0.11, "minus_exact": diff(1e-2, 0.04)}}
    summary = {"map_forward": {**metric, "bf16": {"mean": 1e-3, "minus_exact": diff(1e-3, 1e-6)}},
               "map_round_trip": metric, "nvfp4": metric, "int4": metric, "int2": metric}
    results = {"command": "python -m bench.fidelity.map_precision", "mantissa_bits": {"tf32": 10, "bf16": 7}, "layers": 28,
               "batches": 2, "widths": [192, 512], "rank": 32, "formats": [["nvfp4", "nvfp4", 16], ["int4", "int4", 32], ["int2", "int2", 32]],
               "summary": summary}
    path = tmp_path / "map_precision.json"
    path.write_text(json.dumps(results))
    text = block(path=path)
    starred = [line.split(" |")[0] for line in text.splitlines() if line.startswith("|") and "*" in line]
    assert starred == ["| map_forward"]
    assert "bf16 changes the codec's error by at most" in text and "resolved at no format" in text
    assert "over the table's 10 comparisons" in text
