"""Tensor parallelism x FSDP (2-D) with GIFT on torchtitan's stock FSDP2 trainer, 4 gloo ranks
(TP 2 x FSDP 2).

Three runs, same seed, init and data (~20-60 s each on a 2-core box): GIFT at nvfp4 (a refresh
after step 2, so step 3 runs the measured selection with the TP-local maps), GIFT at fp32, and
GIFT off. Each TP rank's weight block is its own GIFT matrix (colwise: [out/2, in], rowwise:
[out, in/2]); its reduce-scatter over the 2-rank FSDP group is GIFT's, and TP's activation
collectives are left as they are. nvfp4 must quantize (round-trip error > 0), count at the
collective exactly the bytes its plans account for, and stay within the 2-rank tests' loss
tolerance of the GIFT-off run; fp32 must have zero error and reproduce GIFT-off's losses exactly
(a sum of two fp32 gradients is the same in either order).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.runs import RunResult, run_config  # noqa: E402

STEPS = 3
TP = ["--parallelism.tensor-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    cache: dict[str, RunResult] = {}
    configs = {
        "nvfp4": ("llama3_debug_gift_fsdp2", [*TP, *GIFT, "--gift.format=nvfp4"]),
        "fp32": ("llama3_debug_gift_fsdp2", [*TP, *GIFT, "--gift.format=fp32"]),
        "off": ("llama3_debug_nogift_fsdp2", TP),
    }

    def get(which: str) -> RunResult:
        if which not in cache:
            config, overrides = configs[which]
            folder = str(tmp_path_factory.mktemp(which))
            cache[which] = run_config(config, overrides, dump_folder=folder, nproc=4).check()
        return cache[which]

    return get


def _steps(run: RunResult) -> list[dict]:
    steps = [r for r in run.records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def _assert_no_refusal_or_fallback(run: RunResult) -> None:
    assert "gift.enable supports FSDP" not in run.output
    assert not [line for line in run.output.splitlines()
                if "GIFT" in line and ("WARNING" in line or "full precision" in line)]


def test_fsdp2_tp_quantizes_each_tp_block_at_nvfp4_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("nvfp4"), runs("off")
    _assert_no_refusal_or_fallback(gift)
    # each managed weight is this TP rank's block: colwise rows halved, rowwise columns halved
    blocks = re.search(r"GIFT TP: 20 managed weights are this TP rank's blocks, each its own GIFT matrix with "
                       r"statistics reduced over the 2-rank data-parallel group: (.*)", gift.output)
    assert blocks, gift.output[-3000:]
    for colwise in ("layers.0.attention.qkv_linear.wqkv.weight [384, 128] -> [192, 128]",
                    "layers.3.feed_forward.w1.weight [384, 128] -> [192, 128]"):
        assert colwise in blocks.group(1)
    for rowwise in ("layers.0.attention.wo.weight [128, 128] -> [128, 64]",
                    "layers.3.feed_forward.w2.weight [128, 384] -> [128, 192]"):
        assert rowwise in blocks.group(1)
    # what fp32 would have handed over: the TP-local gradients (embedding and head [2048, 128]
    # each, per block wqkv/w1/w3 [192, 128] and wo [128, 64], w2 [128, 192], 9 norms of 128), not
    # the global ones (7.61 MB)
    tp_local = 2 * 2048 * 128 + 4 * (3 * 192 * 128 + 128 * 64 + 128 * 192) + 9 * 128
    for r in _steps(gift):
        assert r["gift/baseline_bytes_per_step"] == 4 * tp_local, r
        # bytes handed to GIFT's reduce-scatters (counted at run time) == the TP-local plans' accounting
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/collectives_per_step"] == 6, r  # one per FSDP parameter group
        assert r["gift/compression"] > 1.5, r
    # the round trip at nvfp4 on the TP-local blocks, measured at the refresh
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert gift.last("gift/managed_layers") == 20
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1]  # same init, data and forward: only the gradient path differs
    assert any(g[s] != o[s] for s in g if s > 1)  # and that path did quantize
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


def test_fsdp2_tp_at_fp32_is_exact_and_matches_gift_off(runs: Callable[[str], RunResult]) -> None:
    exact, off = runs("fp32"), runs("off")
    _assert_no_refusal_or_fallback(exact)
    for r in _steps(exact):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()
