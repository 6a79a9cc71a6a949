"""Per-expert input statistics of a grouped GEMM (`gift_compile.geometry.grouped_statistics`):
each expert's statistics equal a per-layer object fed that expert's rows."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from gift_compile.config import StatisticsKind
from gift_compile.geometry.grouped_statistics import (
    GroupedKFACStatistics, GroupedSketchStatistics, make_grouped_statistics,
)
from gift_compile.geometry.maps import LowRank
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics, StatisticsSettings

G, D, R, ROWS = 4, 96, 8, 80
# expert 2 gets no token; rows 70..79 are padding
COUNTS = [20, 30, 0, 20]


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _tokens(seed: int = 0, rows: int = ROWS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, 1, D)[torch.randperm(D, generator=gen)]
    return (torch.randn(rows, D, generator=gen) * scale).to(torch.bfloat16)


def _slices(counts: list[int]) -> list[slice]:
    ends = _offsets(counts).tolist()
    return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends)]


def _sketch(max_tokens: int = 1024) -> GroupedSketchStatistics:
    return GroupedSketchStatistics(G, D, rank=R, ema=0.5, max_tokens=max_tokens)


def _alone(max_tokens: int = 1024) -> SketchStatistics:
    return SketchStatistics(D, rank=R, ema=0.5, max_tokens=max_tokens)


def test_each_expert_equals_a_layer_fed_its_rows() -> None:
    """No subsampling: window sketch, diagonal and counters of each expert equal a standalone
    `SketchStatistics` observing that expert's rows; padding rows (huge, even Inf) add nothing."""
    grouped, x = _sketch(), _tokens()
    x[70:] = 3e38
    x[75, 3] = float("inf")
    grouped.observe(x, _offsets(COUNTS))
    for e, rows in enumerate(_slices(COUNTS)):
        want, got = _alone(), grouped.expert(e)
        if rows.stop > rows.start:
            want.observe(x[rows])
        torch.testing.assert_close(got.y_acc, want.y_acc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.diag_acc, want.diag_acc, rtol=1e-5, atol=0.0)
        assert float(got.count) == float(want.count) == COUNTS[e] and float(got.tokens) == COUNTS[e]
        assert int(got.dropped) == 0
    assert float(grouped.expert(2).y_acc.abs().sum()) == 0.0  # the empty expert got nothing


def test_expert_views_write_through_to_the_stacked_state() -> None:
    grouped = _sketch()
    grouped.observe(_tokens(), _offsets(COUNTS))
    e1 = grouped.expert(1)
    assert e1.y_acc.data_ptr() == grouped.state["y_acc"][1].data_ptr()
    assert e1.omega is grouped.omega and e1.cols == grouped.cols == 2 * R
    e1.consolidate(None)
    assert bool(grouped.state["initialized"][1]) and not bool(grouped.state["initialized"][0])
    assert float(grouped.state["count"][1]) == 0.0 and float(grouped.state["count"][0]) == COUNTS[0]


def test_nonfinite_token_drops_the_batch_for_every_expert() -> None:
    grouped, x = _sketch(), _tokens()
    grouped.observe(x, _offsets(COUNTS))
    before = {k: t.clone() for k, t in grouped.state.items()}
    bad = x.clone()
    bad[25, 7] = float("nan")  # a token of expert 1
    grouped.observe(bad, _offsets(COUNTS))
    for key in ("y_acc", "diag_acc", "count"):
        assert torch.equal(grouped.state[key], before[key]), key
    assert grouped.state["dropped"].tolist() == [1] * G
    assert grouped.state["tokens"].tolist() == [2 * c for c in COUNTS]  # the tokens were seen


def test_gate_off_adds_nothing() -> None:
    grouped = _sketch()
    grouped.observe(_tokens(), _offsets(COUNTS), gate=torch.tensor(False))
    assert all(int(t.count_nonzero()) == 0 for k, t in grouped.state.items() if k != "holder")
    grouped.observe(_tokens(), _offsets(COUNTS), gate=torch.tensor(True))
    assert grouped.state["count"].tolist() == COUNTS


def test_subsampling_takes_the_layers_stride() -> None:
    """`max_tokens` < R: the stride over all R rows is the one `SketchStatistics` takes (here 4:
    rows 0, 4, ...), and each expert gets the sampled rows that fall in its range."""
    grouped, x = _sketch(max_tokens=20), _tokens()
    grouped.observe(x, _offsets(COUNTS))
    sampled = torch.arange(0, ROWS, 4)
    for e, rows in enumerate(_slices(COUNTS)):
        mine = sampled[(sampled >= rows.start) & (sampled < rows.stop)]
        want = _alone()
        if len(mine):
            want.observe(x[mine])
        torch.testing.assert_close(grouped.expert(e).y_acc, want.y_acc, rtol=1e-5, atol=1e-5)
        assert float(grouped.expert(e).count) == len(mine) and float(grouped.expert(e).tokens) == COUNTS[e]
    # the sampled padding rows (72, 76) are not counted
    assert float(grouped.state["count"].sum()) == 18


def test_expert_whitening_equals_a_standalone_layers() -> None:
    grouped, xs = _sketch(), [_tokens(seed) for seed in (0, 1)]
    alone = [_alone() for _ in range(G)]
    for x in xs:
        grouped.observe(x, _offsets(COUNTS))
        for e, rows in enumerate(_slices(COUNTS)):
            if rows.stop > rows.start:
                alone[e].observe(x[rows])
    for e in (0, 1, 3):
        assert grouped.expert(e).consolidate(None) and alone[e].consolidate(None)
        for got, want in zip(grouped.expert(e).whitening(R, 1e-3), alone[e].whitening(R, 1e-3)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # a map refreshes from the expert's statistics as from a layer's
        m = LowRank(D, R)
        m.refresh_from_stats(grouped.expert(e), 1e-3)
        assert not torch.equal(m.tensors[0], torch.ones(D))
    assert not grouped.expert(2).consolidate(None)  # the empty expert has nothing to whiten from


def test_expert_state_dict_round_trips_through_the_views() -> None:
    grouped, other = _sketch(), _sketch()
    grouped.observe(_tokens(), _offsets(COUNTS))
    other.expert(3).load_state_dict(grouped.expert(3).state_dict())
    assert torch.equal(other.state["y_acc"][3], grouped.state["y_acc"][3])
    assert float(other.state["y_acc"][:3].abs().sum()) == 0.0


def test_kfac_experts_equal_layers_fed_their_rows() -> None:
    grouped, x = GroupedKFACStatistics(G, D, ema=0.5, max_tokens=1024), _tokens()
    x[70:] = float("nan")
    grouped.observe(x, _offsets(COUNTS))
    for e, rows in enumerate(_slices(COUNTS)):
        want = KFACStatistics(D, ema=0.5, max_tokens=1024)
        if rows.stop > rows.start:
            want.observe(x[rows])
        torch.testing.assert_close(grouped.expert(e).acc, want.acc, rtol=1e-5, atol=1e-4)
        assert float(grouped.expert(e).count) == COUNTS[e]
    torch.testing.assert_close(grouped.expert(1).consolidate(None), x[20:50].float().t() @ x[20:50].float() / 30,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("grouped", [_sketch(), GroupedKFACStatistics(G, D, ema=0.5, max_tokens=1024)],
                         ids=["sketch", "kfac"])
def test_a_forward_with_no_tokens_adds_nothing(grouped: GroupedSketchStatistics | GroupedKFACStatistics) -> None:
    """An expert-parallel rank may be routed no token in a step: an empty input is no error."""
    grouped.observe(torch.zeros(0, D, dtype=torch.bfloat16), _offsets([0, 0, 0, 0]))
    assert not any(bool(t.any()) for t in grouped.state.values() if t.dtype != torch.int64)


@pytest.mark.parametrize(("d_in", "kind"), [(96, GroupedSketchStatistics), (16, GroupedKFACStatistics)])
def test_make_grouped_statistics_chooses_as_a_layer_does(d_in: int, kind: type) -> None:
    settings = StatisticsSettings(StatisticsKind.SKETCH, rank=R, sketch_cols=2 * R, ema=0.5, max_tokens=64, seed=3)
    grouped = make_grouped_statistics(settings, G, d_in, "cpu")
    layer = LowRank.make_statistics(settings, d_in, "cpu")
    assert isinstance(grouped, kind) and isinstance(grouped.expert(0), type(layer))
    if isinstance(layer, SketchStatistics):
        assert torch.equal(grouped.omega, layer.omega)


def test_bad_inputs_are_clear_errors() -> None:
    grouped = _sketch()
    with pytest.raises(ValueError, match=r"offsets must be an int tensor of shape \(4,\)"):
        grouped.observe(_tokens(), _offsets(COUNTS[:3]))
    with pytest.raises(ValueError, match="offsets must be an int tensor"):
        grouped.observe(_tokens(), _offsets(COUNTS).float())
    with pytest.raises(ValueError, match="expected \\[rows, d_in=96\\]"):
        grouped.observe(_tokens()[:, :10], _offsets(COUNTS))
    with pytest.raises(ValueError, match="groups must be a positive int"):
        GroupedSketchStatistics(0, D, ema=0.5, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        GroupedSketchStatistics(G, D, ema=0.5, max_tokens=0)


def test_observe_compiles_once_for_any_token_counts() -> None:
    torch._dynamo.reset()
    eager, comp = _sketch(max_tokens=40), _sketch(max_tokens=40)
    counter = CompileCounterWithBackend("inductor")

    def forward(stats: GroupedSketchStatistics, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        stats.observe(x, offsets)
        return x * 2

    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=False)
    batches = [(_tokens(0), _offsets(COUNTS)), (_tokens(1), _offsets([5, 5, 50, 10])),
               (_tokens(2), _offsets([80, 0, 0, 0]))]
    torch._dynamo.config.error_on_recompile = True
    try:
        for x, offsets in batches:
            compiled(comp, x, offsets)
            forward(eager, x, offsets)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert counter.frame_count == 1
    assert torch.equal(comp.state["count"], eager.state["count"])
    assert torch.equal(comp.state["tokens"], eager.state["tokens"])
    assert eager.state["tokens"].tolist() == [105, 35, 50, 30]
    torch.testing.assert_close(comp.state["y_acc"], eager.state["y_acc"], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(comp.state["diag_acc"], eager.state["diag_acc"], rtol=1e-5, atol=1e-5)
