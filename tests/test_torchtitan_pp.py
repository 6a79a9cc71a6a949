"""Pipeline parallelism with GIFT on torchtitan's FSDP2 trainer, 4 gloo ranks (PP 2 x FSDP 2).

Three runs of the ``gift_debug`` Llama (4 layers, 3 steps, 4 microbatches per step), shared by
the tests of this module (~20-40 s each on a 2-core box): GIFT at nvfp4 with 1F1B (one model
part per rank: stage 0 holds layers 0-1, stage 1 layers 2-3), GIFT at nvfp4 with
Interleaved1F1B (two model parts per rank: stages 0+2 and 1+3), and GIFT off with 1F1B.
A refresh after step 2 puts step 3 on the measured selection. Tolerance against GIFT off:
the 2-rank tests' 5e-3 per step. Each pipeline rank writes its own telemetry
(``gift_metrics.pp<k>.jsonl``): each stage's GIFT state manages its own layers.

A fourth run (`tests/torchtitan_nan_config.py`) puts a NaN into one stage-1 gradient on one
rank in step 2: every rank of both stages raises the same error at step 2's optimizer step,
before any optimizer starts.

Also, without torchrun: `manage` over several parts, the statistics pause of the stages'
shape inference, and graph_trainer's refusal of pipeline parallelism.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.frameworks.routing import manage, statistics_paused  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL, data_parallel_group  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import RunResult, config_command, run_env, shared_runs  # noqa: E402

STEPS = 3
PP = ["--parallelism.pipeline-parallel-degree=2", "--parallelism.data-parallel-shard-degree=2",
      "--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1"]
GIFT = ["--gift.format=nvfp4", "--gift.refresh-every=2", "--gift.no-fuse"]
INTERLEAVED = ["--parallelism.pipeline-parallel-schedule=Interleaved1F1B"]
TOLERANCE = 5e-3
# The transformer blocks each pipeline rank holds (torchtitan's split of 4 layers).
BLOCKS = {"gift": {0: {0, 1}, 1: {2, 3}}, "interleaved": {0: {0, 3}, 1: {1, 2}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], RunResult]:
    return shared_runs({
        "gift": ("llama3_debug_gift_fsdp2", [*PP, *GIFT]),
        "interleaved": ("llama3_debug_gift_fsdp2", [*PP, *GIFT, *INTERLEAVED]),
        "off": ("llama3_debug_nogift_fsdp2", PP),
    }, lambda name: str(tmp_path_factory.mktemp(name)), nproc=4)


def _check_stages(run: RunResult, which: str, parts: int) -> None:
    """Both pipeline ranks manage their own blocks, quantize them at nvfp4, hand the collective
    exactly the accounted bytes once per optimizer step, and refresh at optimizer step 2."""
    assert REFUSAL not in run.output  # no refusal
    assert not run.gift_warnings()
    assert sorted(run.stages) == [0, 1]
    for stage, records in run.stages.items():
        managed = f"GIFT: 10 weights managed on pipeline rank {stage} ({parts} model parts, data-parallel group of 2)"
        assert managed in run.output
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        for r in steps:
            # counted where handed to the reduce-scatter == the plans' accounting; one reduce-scatter per
            # FSDP module per optimizer step (4 microbatches; the first step's shape inference not counted)
            assert r["gift/wire_bytes_per_step"] == r["gift/accounted_bytes_per_backward"] > 0, (stage, r)
            assert r["gift/collectives_per_step"] == 3, (stage, r)
            assert r["gift/total_compression"] > 1.5, (stage, r)
            assert r["gift/managed_layers"] == 10
        # the step driver ran once per optimizer step (per part or per microbatch, refresh_every=2 would come earlier)
        refresh = [r for r in steps if "gift/refresh_step" in r]
        assert [r["gift/refresh_step"] for r in refresh] == [2.0] and refresh[0]["step"] == 2, (stage, refresh)
        # the stage's own layers, with nvfp4's round-trip error (> 0: the gradients were quantized)
        layers = {k.removeprefix("gift/err_euclidean/") for k in refresh[0] if k.startswith("gift/err_euclidean/")}
        assert {int(re.match(r"layers\.(\d+)\.", n).group(1)) for n in layers} == BLOCKS[which][stage], layers
        assert len(layers) == 10
        assert 0.02 < refresh[0]["gift/err_euclidean_mean"] < 0.3, refresh[0]
    # the main record is the last stage's (the only one that sees the loss)
    assert [r["loss"] for r in run.records] == [r["loss"] for r in run.stages[1]]


def test_pp_fsdp2_manages_and_quantizes_every_stage_and_tracks_gift_off(runs: Callable[[str], RunResult]) -> None:
    gift, off = runs("gift"), runs("off")
    _check_stages(gift, "gift", parts=1)
    g, o = gift.losses(), off.losses()
    assert sorted(g) == sorted(o) == list(range(1, STEPS + 1))
    assert g[1] == o[1]  # same init, data and forward: only the gradient path differs
    assert g != o  # nvfp4 gradients moved the later losses
    for step in g:
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


def test_pp_interleaved_one_state_over_two_parts_per_rank(runs: Callable[[str], RunResult]) -> None:
    inter, off = runs("interleaved"), runs("off")
    assert "Using pipeline schedule Interleaved1F1B" in inter.output
    _check_stages(inter, "interleaved", parts=2)
    g, o = inter.losses(), off.losses()
    for step in g:  # another schedule sums the microbatches in another order: not bitwise, within tolerance
        assert abs(g[step] - o[step]) < TOLERANCE, (step, g, o)


def test_pp_nan_on_one_stage_raises_on_every_rank_before_any_optimizer_step(tmp_path: Path) -> None:
    """A NaN in one stage-1 weight's gradient on rank 2, in step 2 only: stage 1's GIFT state
    (ranks 2 and 3) sees it, stage 0's (ranks 0 and 1) does not. Every rank raises the same
    FloatingPointError, naming rank 2 and the states of ranks 2 and 3, and no optimizer of any
    rank starts step 2 (so no weight changed). Without the job-wide check, ranks 2 and 3 raised
    in their backward and ranks 0 and 1 died on a closed gloo connection or were killed."""
    import torchtitan_nan_config as nan

    command = config_command("llama3_debug_gift_fsdp2_nan", [*PP, "--gift.no-fuse", "--module", nan.__name__],
                             dump_folder=str(tmp_path), nproc=4)
    env = run_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    raised = {int(rank): line for rank, line in re.findall(r"^\[rank(\d+)\]: (\w+: GIFT: .*)$", output, re.M)}
    assert sorted(raised) == [0, 1, 2, 3], output[-6000:]
    assert len(set(raised.values())) == 1, raised  # the same error, word for word
    error = raised[0]
    assert error.startswith("FloatingPointError: GIFT: gradient collectives in this step carried NaN/Inf from "
                            f"rank(s) [{nan.FAULT_RANK}] (seen by the GIFT states of rank(s) [2, 3]"), error
    assert "raised on all 4 ranks before the optimizer step" in error
    # every rank's optimizers started step 1 and none started the faulty step
    starts = {(int(step), int(rank)) for step, rank in re.findall(nan.STARTS.format(step=r"(\d+)", rank=r"(\d+)"),
                                                                   output)}
    assert starts == {(step, rank) for step in range(1, nan.FAULT_STEP) for rank in range(4)}, starts


def _part(block: int) -> nn.Module:
    """A pipeline stage as torchtitan builds it: the whole model's names, other blocks pruned."""
    return nn.ModuleDict({"layers": nn.ModuleDict({str(block): nn.Linear(64, 64, bias=False)})})


def test_manage_spans_parts_and_refuses_shared_names() -> None:
    config = GiftConfig(geometry="lowrank", min_numel=0)
    a, b = _part(0), _part(3)
    state = manage([a, b], config, None, mode="stats")
    assert list(state.layers) == ["layers.0.weight", "layers.3.weight"]
    assert a._gift_state is state and b._gift_state is state
    with pytest.raises(ValueError, match="layers.1.weight is in two model parts"):
        manage([_part(1), _part(1)], config, None, mode="stats")


def test_statistics_paused_keeps_shape_inference_out_of_the_statistics() -> None:
    part = _part(0)
    state = manage(part, GiftConfig(geometry="lowrank", min_numel=0), None, mode="stats")
    stats = state.layers["layers.0.weight"].stats
    linear = part["layers"]["0"]
    with statistics_paused():
        linear(torch.randn(8, 64) * 1e6)  # a stage's uninitialized shape-inference input (finite garbage)
    assert float(stats.count) == 0
    linear(torch.randn(8, 64))
    assert float(stats.count) == 8


@pytest.mark.parametrize("trainer,dims,names", [
    ("graph", {"pp": 2}, "pipeline on graph_trainer parallelism is on .*only on its whole-step trace.*GraphPP"),
    ("fsdp2", {"pp": 2, "ep": 2, "cp": 2}, "expert with context parallelism is on .*mixed torch.Tensor and DTensor"),
])
def test_pipeline_refusals_name_the_reason(trainer: str, dims: dict[str, int], names: str) -> None:
    parallel_dims = SimpleNamespace(**{"tp": 1, "cp": 1, "pp": 1, "ep": 1, "dp_replicate": 1, "dp_shard": 2, **dims})
    with pytest.raises(ValueError, match=names) as err:
        data_parallel_group(parallel_dims, trainer)
    assert ("pipeline on graph_trainer" in str(err.value)) is (trainer == "graph")


def test_pipeline_without_data_parallelism_is_refused() -> None:
    def dims(**degrees: int) -> SimpleNamespace:
        return SimpleNamespace(**{"tp": 1, "cp": 1, "ep": 1, **degrees},
                               get_mesh=lambda name: SimpleNamespace(get_group=lambda: name))

    with pytest.raises(ValueError, match="needs data parallelism: .*not the activations"):
        data_parallel_group(dims(pp=2, dp_shard=1, dp_replicate=1), "fsdp2")
    assert data_parallel_group(dims(pp=2, dp_shard=1, dp_replicate=2), "fsdp2") == "batch"  # PP x DDP-style replicas: GIFT's hop
