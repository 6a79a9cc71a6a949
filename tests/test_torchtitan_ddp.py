"""Replication only (DDP: dp_replicate 2, dp_shard 1) with GIFT on torchtitan's graph_trainer, 2 gloo ranks.

SimpleFSDP's ``replicate`` mode traces one sum all-reduce per gradient over dp_replicate into the
step; the gift pass rewrites each one that carries a managed weight into GIFT's all-reduce with
that layer's own plan (its format, error feedback and gradient probe: there is no second hop),
as on any torch.compile'd DDP-style graph. Three runs, same seed, init and data: GIFT at nvfp4 (a
refresh after step 2), GIFT at fp32 (every item raw: must reproduce GIFT off's losses exactly)
and GIFT off. The FSDP2 trainer's DDP (HSDP with one shard: GIFT's replica hop is the only one)
is a row of `bench.cluster.layouts`. Measured 2026-12-05 on 2 cores shared with other jobs: 70 s per run
at load 15-20 (``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_torchtitan_ddp.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.exchange.accounting import HEADER_BYTES  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.hsdp import check_replicate_only  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import EXACT_FP32, RunResult, shared_runs  # noqa: E402
from torchtitan_checks import assert_tracks_gift_off, logged_steps  # noqa: E402

STEPS = 3
DDP = ["--parallelism.data-parallel-replicate-degree=2", "--parallelism.data-parallel-shard-degree=1",
       "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
TOLERANCE = 5e-3  # the 2-rank tests' per-step loss tolerance (tests/test_torchtitan_train.py)
MANAGED = 20  # the debug Llama's linears: 4 blocks x (wqkv, wo, w1, w2, w3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "nvfp4": ("llama3_debug_gift_graph", [*DDP, *GIFT, "--gift.format=nvfp4"]),
        "fp32": ("llama3_debug_gift_graph", [*DDP, *GIFT, *EXACT_FP32]),
        "off": ("llama3_debug_nogift_graph", DDP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=2)


def test_graph_ddp_rewrites_every_gradient_all_reduce_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, exact, off = runs("nvfp4"), runs("fp32"), runs("off")
    for run in (gift, exact):
        assert REFUSAL not in run.output
        assert not run.gift_warnings()
        # every traced all-reduce of a managed gradient became GIFT's, none fell back; every trace
        found = re.findall(r"GIFT rewrite: (\d+) all-reduces \(0 buckets\) carrying (\d+) managed weights, 0 fallbacks",
                           run.output)
        assert found and set(found) == {(str(MANAGED), str(MANAGED))}, run.output[-3000:]
    for r, f in zip(logged_steps(gift, STEPS), logged_steps(exact, STEPS)):
        for rec in (r, f):
            # bytes handed to GIFT's all-reduces (counted at run time) == the pass's accounting
            assert rec["gift/wire_bytes_per_step"] == rec["gift/accounted_bytes_per_backward"], rec
            assert rec["gift/collectives_per_step"] == MANAGED, rec
        assert r["gift/baseline_bytes_per_step"] == f["gift/baseline_bytes_per_step"]
        # nvfp4 codes: under a third of the fp32 all-reduce's bytes (an fp32 item goes through an
        # all_to_all and an all_gather: 1.5x its bytes at 2 ranks, plus a header per rank and call)
        assert r["gift/wire_bytes_per_step"] < r["gift/baseline_bytes_per_step"] / 3, r
        assert f["gift/wire_bytes_per_step"] == 1.5 * f["gift/baseline_bytes_per_step"] + MANAGED * 2 * HEADER_BYTES, f
    assert gift.last("gift/refresh_step") == 2
    assert 0.03 < gift.last("gift/err_euclidean_mean") < 0.3
    assert exact.last("gift/err_euclidean_mean") == 0.0
    assert exact.losses() == off.losses()
    assert_tracks_gift_off(gift, off, TOLERANCE)


def test_graph_ddp_refuses_a_replica_format_of_its_own() -> None:
    check_replicate_only(GiftConfig(format="nvfp4"))
    with pytest.raises(ValueError, match=r"replica_format='int4': .* only replicates \(DDP\), so each gradient crosses "
                                         r"ranks once, in GIFT's all-reduce at gift.format='nvfp4'"):
        check_replicate_only(GiftConfig(format="nvfp4", replica_format="int4"))
