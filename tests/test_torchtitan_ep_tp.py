"""Expert parallelism x tensor parallelism x FSDP with GIFT on the stock FSDP2 trainer, 4 gloo
ranks (FSDP 2 x TP 2, EP 2: torchtitan's efsdp mesh is dp_shard x tp / ep = 2 ranks).

The layout of tests/test_torchtitan_ep.py (see its docstring: GIFT on every FSDP module's fsdp
parameter group, the routed experts on FSDP2's own reduce-scatter over efsdp) with TP on the
dense blocks: each TP rank's attention and shared-expert block is its own GIFT matrix, as in
tests/test_torchtitan_tp.py. The TP-halved blocks of this tiny model have 2048-3072 elements,
under the default ``min_numel`` 4096, so the runs set 1024 (21 managed blocks). Two runs, same
seed, init and data: GIFT at nvfp4 (a refresh after step 2) and GIFT off. Measured 2026-12-05 on
2 cores shared with other jobs: the file 70 s at load 4, ~3 min at load 12-17
(``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ep_tp.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.torchtitan_ext.runs import RunResult, shared_runs  # noqa: E402
from test_torchtitan_ep import GIFT, STEPS, TOLERANCE, _assert_experts_named_and_nothing_else, _steps  # noqa: E402

EP_TP = ["--parallelism.data-parallel-shard-degree=2", "--parallelism.tensor-parallel-degree=2",
         "--parallelism.expert-parallel-degree=2", "--validator.no-enable", f"--training.steps={STEPS}",
         "--metrics.log-freq=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "tp_nvfp4": ("moe_debug_gift_fsdp2", [*EP_TP, *GIFT, "--gift.format=nvfp4", "--gift.min-numel=1024"]),
        "tp_off": ("moe_debug_nogift_fsdp2", EP_TP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def test_ep_with_tp_quantizes_each_tp_block_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("tp_nvfp4"), runs("tp_off")
    _assert_experts_named_and_nothing_else(gift)
    blocks = re.search(r"GIFT TP: 21 managed weights are this TP rank's blocks, each its own GIFT matrix with "
                       r"statistics reduced over the 2-rank data-parallel group: (.*)", gift.output)
    assert blocks, gift.output[-3000:]
    for block in ("layers.1.moe.shared_experts.w1.weight [64, 64] -> [32, 64]",
                  "layers.2.moe.shared_experts.w2.weight [64, 64] -> [64, 32]",
                  "layers.2.attention.wo.weight [64, 64] -> [64, 32]"):
        assert block in blocks.group(1)
    for r in _steps(gift):
        assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"], r
        assert r["gift/wire_bytes_per_step"] < 0.9 * r["gift/baseline_bytes_per_step"], r
        assert r["gift/collectives_per_step"] == 5, r
        assert r["gift/full_precision_params"] == 6, r
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1]
    assert any(g[s] != o[s] for s in g if s > 1)
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)
