"""`bench.cluster.layouts` records a run that fails without GIFT's refusal as a failed row with its
error (the layout table on docs/benchmarks.md shows it), so the error must be the one that
stopped the run: the first exception any rank printed, not torchrun's wrapper around it."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from bench.cluster.layout_table import SUITE, planned  # noqa: E402
from bench.cluster.layouts import failure, refusal, replica_only  # noqa: E402
from gift_compile.torchtitan_ext.hooks import REFUSAL  # noqa: E402
from gift_compile.torchtitan_ext.cpu.runs import RunResult  # noqa: E402


def _run(output: str) -> RunResult:
    return RunResult(["python", "-m", "torch.distributed.run"], 1, output, 1.0)


def test_a_failure_is_the_first_exception_a_rank_printed_and_a_refusal_is_not_one() -> None:
    failed = _run("\n".join([
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: RuntimeError: shape '[2, 64]' is invalid for input of size 96",
        "[rank0]: torch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ]))
    assert refusal(failed) is None
    assert failure(failed) == "RuntimeError: shape '[2, 64]' is invalid for input of size 96"
    assert failure(_run("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nkilled")) == (
        "exit code 1, no exception in the log")
    refused = _run(f"[rank0]: ValueError: {REFUSAL}; pipeline on graph_trainer")
    assert refusal(refused) == f"{REFUSAL}; pipeline on graph_trainer"


def test_graph_trainers_ddp_hop_is_named_the_replica_hop_and_no_other_is_renamed() -> None:
    hop = {"counted": [1.0], "accounted": [1.0], "fp32": [4.0], "counted_equals_accounted": True}
    ddp = "GIFT rewrite: 20 all-reduces (0 buckets) carrying 20 managed weights, 0 fallbacks"
    hsdp = ("GIFT rewrite: 4 reduce-scatters (4 buckets) carrying 20 managed weights, 0 fallbacks; replica hop (HSDP): "
            "4 all-reduces of the reduced shards after them")
    assert replica_only({"shard": hop}, ddp) == {"replica": hop}
    assert replica_only({"shard": hop}, hsdp) == {"shard": hop}
    assert replica_only({"shard": hop, "replica": hop}, ddp) == {"shard": hop, "replica": hop}
    assert replica_only({"shard": hop}, None) == {"shard": hop}


def test_every_suite_test_the_layout_table_names_exists() -> None:
    """Each pytest node id of `SUITE` names a test function in its file, with its parameter
    among that file's values (a renamed or removed test would leave the table citing nothing)."""
    root = Path(__file__).resolve().parent.parent
    assert set(SUITE) <= set(planned())
    for key, ids in SUITE.items():
        for node in ids:
            found = re.fullmatch(r"(tests/\w+\.py)::(test_\w+)(?:\[(\w+)\])?", node)
            assert found, (key, node)
            path, name, param = found.groups()
            source = (root / path).read_text()
            assert f"def {name}(" in source, (key, node)
            if param:
                assert f'"{param}"' in source, (key, node)


def test_a_resume_that_differs_says_whether_gift_off_differs_too() -> None:
    from bench.pages.layouts import _kill_resume

    base = {"bit_identical": False, "differing_tensors": 268, "replayed_steps": [4, 5, 6], "max_abs_loss_diff": 3.8e-6,
            "trained_tensors_compared": 758}
    off = {"bit_identical": False, "differing_tensors": 124, "trained_tensors_compared": 166, "max_abs_loss_diff": 1.9e-6}
    assert "GIFT off differs too (124 of 166 tensors" in _kill_resume({**base, "gift_off": off})
    assert "GIFT off is bit-identical: GIFT's" in _kill_resume({**base, "gift_off": {**off, "bit_identical": True}})
    assert _kill_resume({**base, "bit_identical": True}).startswith("bit-identical: steps 4-6 replayed")
