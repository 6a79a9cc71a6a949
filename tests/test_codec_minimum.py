"""bench.fidelity.codec_minimum: the minimum traffic of a codec body, by hand for one case, and the
generated kernels of a tiny body never beating it."""

from __future__ import annotations

import pytest

from bench.fidelity.codec_minimum import measure, minimum_bytes, unfused
from bench.lib.settings import CodecMinimumSettings


def test_euclidean_fp8_reduce_scatter_minimum_by_hand() -> None:
    rows, cols, world = 1280, 3456, 8
    n = rows * cols
    codes_and_scales = (n * 1 + rows * 4) / n  # one fp8 byte per element, one fp32 scale per row
    hand = 4 + codes_and_scales + codes_and_scales + 2 * 16 * world / n + 4 / world
    t = minimum_bytes("reduce_scatter", "fp8_e4m3", "row", "identity", rows, cols, 32, world)
    assert t["total"] == pytest.approx(hand, rel=1e-12)
    assert t["gradient"] == 4 and t["output"] == 0.5 and t["map"] == 0


def test_low_rank_nvfp4_all_reduce_terms_by_hand() -> None:
    rows, cols, world, r = 1280, 3456, 8, 32
    n = rows * cols
    w = (n // 2 + n // 16 + 4) / n  # 4-bit codes, an E4M3 code per 16 elements, the fp32 tensor scale
    t = minimum_bytes("all_reduce", "nvfp4", "row", "lowrank", rows, cols, r, world)
    assert t["gradient"] == 8  # the tensor scale forces a second sweep
    assert t["projection"] == pytest.approx(4 + 4 * r / cols * 3)
    assert t["reduced shard"] == pytest.approx(min(w, 12 / world))
    assert t["gather send"] == pytest.approx(w / world) and t["gather receive"] == pytest.approx(w)
    # decoded values written for the matmul and read by it; the expansion decodes the gathered codes again
    assert t["inverse"] == pytest.approx(8 + w + 2 * 4 * r / cols)
    assert t["map"] == pytest.approx(4 * ((2 * cols + cols * r + r) + (cols + cols * r + r)) / n)
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))


def test_unmodelled_inputs_raise() -> None:
    with pytest.raises(ValueError, match="sent raw"):
        minimum_bytes("all_reduce", "bf16", "row", "identity", 8, 8, 2, 2)
    with pytest.raises(ValueError, match="transform kind 'hadamard'"):
        minimum_bytes("all_reduce", "fp8_e4m3", "row", "hadamard", 8, 8, 2, 2)
    with pytest.raises(ValueError, match="divisible"):
        minimum_bytes("reduce_scatter", "fp8_e4m3", "row", "identity", 9, 8, 2, 2)


def test_generated_kernels_move_at_least_the_minimum() -> None:
    s = CodecMinimumSettings(shape=("tiny", 64, 256), rank=8, world=2, ops=("reduce_scatter",),
                             formats=(("fp8_e4m3", "row"),), kinds=("identity", "lowrank"), repeats=1)
    res = measure(s, lambda m: None)
    by_kind = {r["kind"]: r for r in res["rows"]}
    for r in res["rows"]:
        assert r["kernels"] > 0 and r["median_ms"] > 0
        assert r["bytes_per_element"] >= r["minimum"] * (1 - 1e-9), r
    assert by_kind["identity"]["vs_euclid_time"] == 1.0
    # the projection matmul is an extern kernel the report names, with its reason
    assert any(k["name"].startswith("aten.mm") for k in unfused(res["kernels"]["reduce_scatter fp8_e4m3 lowrank"]))



ROWS, COLS, WORLD = 64, 256, 2
FULL = ROWS * COLS * 4  # bytes of the fp32 gradient


def _kernels(fmt: str, scaling: str, kind: str) -> list:
    """The generated kernels of a tiny 2-rank reduce-scatter body (rank 8), in schedule order."""
    import torch

    from bench.fidelity.overhead import codec_body, fake_group, generated_traffic

    with fake_group(WORLD) as group:
        body = codec_body(fmt, scaling, kind, ROWS, COLS, 8, world=WORLD, group_name=group, op="reduce_scatter",
                          factor=False)
        kernels, _ = generated_traffic(body, torch.zeros(ROWS, COLS))
    return kernels


def _send_side(kernels: list) -> list:
    return kernels[:next(i for i, k in enumerate(kernels) if k.collective)]


def test_two_level_decode_reads_the_codes_once_into_the_shard() -> None:
    """The receive side of an NVFP4 reduce-scatter reads each sender's codes and scales once
    and writes the fp32 shard, with nothing in between: no per-block unit (E4M3 scale times
    the sender's tensor scale) written out at fp32 and read back, which Inductor does when
    the tensor scale reaches the decode as byte loads and shifts (`exchange._parse_scales`)."""
    from gift_compile.codec import FormatSpec, wire_bytes_for

    kernels = _kernels("nvfp4", "row", "identity")
    first_wait = next(i for i, k in enumerate(kernels) if k.name.startswith("_c10d_functional.wait_tensor"))
    receive = [k for k in kernels[first_wait + 1:] if not k.collective]
    moved = sum(k.reads + k.writes for k in receive)
    wire = wire_bytes_for(FormatSpec("nvfp4", "row"), ROWS, COLS)  # every sender's codes + scales, once
    shard = FULL // WORLD
    assert receive and moved <= wire + shard + 64 * WORLD, (moved, wire, shard, [(k.name, k.reads, k.writes)
                                                                                  for k in receive])


def test_mean_abs_statistic_writes_no_partial_sums() -> None:
    """int2's block statistic (fp64 mean |x|) is one reduction computed in the loop that reads
    the block: that kernel writes one fp64 sum per block, not partial sums (a spelled-out
    pairwise tree wrote four per block here, 1 B per gradient element)."""
    from gift_compile.codec import FormatSpec

    send = _send_side(_kernels("int2", "row", "identity"))
    statistic = send[0]  # the first pass over the gradient
    blocks = ROWS * COLS // FormatSpec("int2", "row", 32).block
    assert statistic.reads >= FULL and statistic.writes <= blocks * 8, [(k.name, k.reads, k.writes) for k in send]


def test_tensor_scale_is_taken_in_the_kernel_writing_the_low_rank_transform() -> None:
    """fp8 with one scale per tensor takes the amax over the rows' maxima, a row reduction the
    CPU backend computes in the loops of the `[rows, cols]` expansion that produces the values
    (`scales.choose_scales`): the transform is read back once, by the encoder, not also by a
    whole-tensor amax pass."""
    send = _send_side(_kernels("fp8_e5m2", "tensor", "lowrank"))
    described = [(k.name, k.reads, k.writes) for k in send]
    assert any("amax" in k.name and k.writes >= FULL for k in send), described
    assert sum(k.reads >= FULL for k in send) == 3, described  # projection, expansion, encoder
