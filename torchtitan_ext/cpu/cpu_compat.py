"""Run torchtitan 0.3.0 on CPU with the gloo backend.

torchtitan has no CPU device option: it assumes an accelerator everywhere. This module
is the single place where GIFT's torchtitan integration makes it run on a CPU-only box
(our CI and development machines have no GPU). Everything here is inert when an
accelerator is present: :func:`activate` only installs the torch-version gaps
(``set_timeout``, the microbatch ``step``; see below) and the other helpers leave torchtitan's
defaults alone.

Two kinds of adjustments, preferring the first:

* Choices made through torchtitan's and torch's own switches (no patching), applied by
  the config functions in :mod:`gift_compile.torchtitan_ext.cpu.config_registry` through
  :func:`attention_backend` and :func:`apply_config_defaults`, and by the trainers
  through :func:`after_fsdp2`:

  - SDPA instead of FlexAttention: FlexAttention has no CPU backward.
  - ``training.disable_cuda_graphs``: CUDA graphs need CUDA.
  - ``cudagraph_pass`` put in ``compile.disable_passes`` (CUDA graphs need CUDA; on CPU it
    only logs an incompatibility warning). It is the only graph_trainer pass switched off:
    FSDP bucketing/reordering and selective activation remat run on CPU exactly as on a GPU,
    with the two shims below.
  - :func:`save_deterministic_sdpa_pass`, inserted by the ``gift`` pipeline before
    ``selective_activation_remat_pass``: CPU runs use SDPA, whose ATen ops are tagged
    ``nondeterministic_seeded`` (dropout), which the remat pass refuses to recompute; with
    dropout 0 they are saved instead.
  - FSDP2 reductions forced to plain SUM (:func:`after_fsdp2`): torchtitan disables
    FSDP's gradient division (it normalises by the global token count itself), which
    makes FSDP2 pick ``ReduceOp.PREMUL_SUM``; gloo only implements SUM/MAX/MIN/PRODUCT.
    ``FSDPModule.set_force_sum_reduction_for_comms(True)`` is FSDP2's own switch for it.

* Runtime shims in :func:`activate`, where torchtitan or Inductor hard-code the accelerator:

  - CPU roofline figures for Inductor's runtime estimator (:func:`_install_cpu_roofline`): the
    FSDP bucketing/reordering pass estimates node runtimes from GPU DRAM bandwidth, which
    Inductor asks ``triton.testing`` for.

  - ring attention for CPU SDPA (:func:`_install_cpu_ring_attention`): torchtitan's context
    parallelism wraps SDPA's q/k/v as DTensors sharded on the sequence, and torch's CP
    dispatcher turns SDPA's CUDA kernels (flash, efficient, cuDNN) into ring attention; the CPU
    kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) has no entry,
    so a CPU CP run stopped in its first forward with "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered". The shim adds that kernel to the same dispatcher, through the same ring loops
    (``_templated_ring_attention`` and its backward) the CUDA kernels use.

  - device type: ``torchtitan.tools.utils`` computes ``device_type =
    _get_available_device_type() or "cuda"`` at import time and several modules copy it
    (and ``device_module``) with ``from ... import``. We rebind those module globals to
    ``"cpu"`` and to :class:`_CpuDeviceModule`.
  - ``_CpuDeviceModule``: ``torch.cpu`` plus the memory API torchtitan's
    ``DeviceMemoryMonitor`` calls (``get_device_name``, ``get_device_properties``,
    ``memory_stats``, ``reset_peak_memory_stats``, ``empty_cache``), reporting the
    process's peak resident set size, and an integer ``current_device`` for
    ``barrier(device_ids=...)``. It is a separate namespace: ``torch.cpu`` itself is not
    modified.
  - ``torch.distributed.set_timeout``: torchtitan calls it after the first step; torch
    2.13 only has ``torch.distributed.distributed_c10d._set_pg_timeout``. The alias is
    installed only where the public name is missing (it is a torch-version gap, not a CPU
    one, so it is installed on any device).
  - ``PipelineSchedule*.step(arg_mbs=, kwarg_mbs=, target_mbs=)``: torchtitan 0.3.0's
    trainer hands the pipeline schedule its microbatches already split (one dataloader batch
    per microbatch); torch 2.13's ``step`` only takes the whole batch and would treat those
    lists as model kwargs ("Expecting 4 arg_mbs but got 1"). :func:`_install_microbatch_step`
    gives ``step`` that form where it is missing (the per-step setup torch's own ``step``
    does, then its ``_step_microbatches``); a torch-version gap, so installed on any device.
  - ``triton`` importable: ``torchtitan.trainer`` imports
    ``torchtitan.distributed.minimal_async_ep.kernels`` (expert-parallel Triton kernels)
    unconditionally, and that module does ``import triton`` at import time. On a box
    without Triton, :func:`import_torchtitan` imports it with a placeholder ``triton``
    module visible only while that one module body executes (so
    ``torch.utils._triton.has_triton_package`` and Inductor never see it). The kernels
    are never launched on CPU; calling one raises a clear error.
"""

from __future__ import annotations

import functools
import importlib
import operator
import importlib.util
import os
import resource
import sys
import types
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch

from .. import platform_hooks

__all__ = [
    "CPU_DISABLED_GRAPH_PASSES",
    "accelerator_available",
    "activate",
    "after_fsdp2",
    "apply_config_defaults",
    "attention_backend",
    "import_torchtitan",
    "is_active",
]

CPU_DISABLED_GRAPH_PASSES: tuple[str, ...] = (
    "cudagraph_pass",
)
"""graph_trainer passes that need CUDA (see the module docstring for each reason)."""

_active = False


def accelerator_available() -> bool:
    """True when torch sees any accelerator (CUDA, ROCm, XPU, MPS, ...)."""
    return torch.accelerator.is_available()


def is_active() -> bool:
    """True once :func:`activate` has applied the CPU shims in this process."""
    return _active


def attention_backend() -> str:
    """Attention backend for config functions: FlexAttention has no CPU backward."""
    return "flex" if accelerator_available() else "sdpa"


class _CpuDeviceProperties:
    """What torchtitan reads from ``get_device_properties``: the memory capacity."""

    def __init__(self) -> None:
        self.total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.name = "cpu"


class _CpuDeviceModule(types.SimpleNamespace):
    """``torch.cpu`` with the memory-statistics API torchtitan's metrics expect.

    Peak memory is the process's peak resident set size (``ru_maxrss``), which cannot be
    reset, so ``reset_peak_memory_stats`` is a no-op and the reported peak is the peak
    since process start.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        # torch.cpu.current_device() returns the string "cpu"; barrier(device_ids=[...])
        # needs an index.
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> _CpuDeviceProperties:
        return _CpuDeviceProperties()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


class _TritonPlaceholder(types.ModuleType):
    """Stands in for ``triton`` / ``triton.language`` while torchtitan is imported.

    Every attribute is another placeholder, calling one returns a placeholder (so
    ``@triton.jit(...)``, ``tl.pointer_type(tl.int64)`` evaluate), and a decorated
    kernel raises when it is launched.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonPlaceholder(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _unavailable_kernel(args[0])
        return self

    def __getitem__(self, item: Any) -> Any:
        return self


def _unavailable_kernel(fn: Any) -> Any:
    name = getattr(fn, "__qualname__", repr(fn))

    class _Kernel:
        def __getitem__(self, grid: Any) -> Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"Triton kernel {name} was called, but Triton is not installed "
                "(gift_compile.torchtitan_ext.cpu.cpu_compat imported torchtitan without it)."
            )

    return _Kernel()


_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def import_torchtitan() -> None:
    """Import ``torchtitan.trainer`` (and graph_trainer) even when Triton is missing.

    Only ``torchtitan/distributed/minimal_async_ep/kernels.py`` needs Triton at import
    time. It is executed from its file with the placeholder ``triton`` modules in
    ``sys.modules`` for the duration of that one module body and registered under its
    own name, so the later package import finds it; nothing else (torch's Inductor in
    particular, which probes ``import triton``) ever sees the placeholder.
    """
    try:
        importlib.import_module("triton")
    except ImportError:
        if _TRITON_KERNELS not in sys.modules:
            _load_kernels_with_placeholder()
    importlib.import_module("torchtitan.trainer")
    importlib.import_module("torchtitan.experiments.graph_trainer.trainer")


def _load_kernels_with_placeholder() -> None:
    root = importlib.util.find_spec("torchtitan")
    assert root is not None and root.submodule_search_locations
    path = os.path.join(root.submodule_search_locations[0], *_TRITON_KERNELS.split(".")[1:]) + ".py"
    spec = importlib.util.spec_from_file_location(_TRITON_KERNELS, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    names = ("triton", "triton.language")
    sys.modules["triton"] = _TritonPlaceholder("triton")
    sys.modules["triton.language"] = sys.modules["triton"].language
    try:
        spec.loader.exec_module(module)
    finally:
        for name in names:
            sys.modules.pop(name, None)
    sys.modules[_TRITON_KERNELS] = module


def _install_set_timeout_alias() -> None:
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout: timedelta, group: Any = None) -> None:
        """Alias of ``_set_pg_timeout`` (torchtitan 0.3.0 calls the public name)."""
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def _install_microbatch_step() -> None:
    """Let ``PipelineScheduleSingle/Multi.step`` take pre-split microbatches (see the module
    docstring); the whole-batch form is left to torch's own ``step``."""
    import inspect

    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        if "arg_mbs" in inspect.signature(original).parameters or getattr(original, "_gift_microbatch_step", False):
            continue
        cls.step = _microbatch_step(original)


def _microbatch_step(original: Any) -> Any:
    def step(self: Any, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, target: Any = None, losses: list | None = None,
             return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """torch's ``step`` (whole batch), or with ``arg_mbs``/``kwarg_mbs``/``target_mbs``
        the same per-step setup followed by ``_step_microbatches`` on those microbatches."""
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                            loss_kwargs=loss_kwargs, **kwargs)
        if args or kwargs or target is not None:
            raise TypeError("PipelineSchedule.step: pass either whole-batch inputs (args, kwargs, target) or "
                            "microbatches (arg_mbs, kwarg_mbs, target_mbs), not both")
        stages = list(getattr(self, "_stages", None) or [self._stage])
        if (self._has_backward and getattr(self, "_backward_requires_autograd", True)
                and not torch.is_grad_enabled()):
            raise RuntimeError("step() requires gradients to be enabled for backward computation; "
                               "it should not be used under torch.no_grad() context. Please call eval() instead.")
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        last = next((s for s in stages if s.is_last), None)
        return self._merge_outputs(last.output_chunks) if last is not None and return_outputs else None

    step._gift_microbatch_step = True  # type: ignore[attr-defined]
    return step


def _rebind_device_globals() -> None:
    """Point every loaded torchtitan module's ``device_type``/``device_module`` at CPU."""
    import torchtitan.tools.utils as tt_utils

    stale_type, stale_module = tt_utils.device_type, tt_utils.device_module
    if stale_type == "cpu":
        return
    cpu_module = _CpuDeviceModule()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        namespace = vars(module)
        if namespace.get("device_type") == stale_type:
            namespace["device_type"] = "cpu"
        if namespace.get("device_module") is stale_module:
            namespace["device_module"] = cpu_module


# Runtime-estimate inputs for Inductor's overlap scheduler on CPU (see _install_cpu_roofline).
CPU_DRAM_GBPS = 20
CPU_TFLOPS = 0.1


def _install_cpu_roofline() -> None:
    """Give Inductor's runtime estimator CPU figures instead of asking Triton for GPU ones.

    graph_trainer's FSDP bucketing/reordering pass (``JointManualOverlapScheduler``) estimates
    every node's runtime as a roofline: bytes over DRAM bandwidth
    (``torch._inductor.utils.get_gpu_dram_gbps``, which imports ``triton.testing``) and FLOPs
    over peak (``get_device_tflops``, which warns and returns 0 without CUDA). The estimates
    only order and group collectives; the pass's decisions do not need to be accurate, only
    defined, so documented round figures for a CPU socket are enough. Patched where torch
    imported the names (``torch.utils._runtime_estimation``, ``torch._inductor.scheduler``).
    """
    import torch._inductor.scheduler as scheduler
    import torch._inductor.utils as inductor_utils
    import torch.utils._runtime_estimation as runtime_estimation

    def cpu_dram_gbps() -> int:
        return CPU_DRAM_GBPS

    def cpu_tflops(dtype: torch.dtype) -> float:
        return CPU_TFLOPS

    for module in (inductor_utils, runtime_estimation, scheduler):
        if hasattr(module, "get_gpu_dram_gbps"):
            module.get_gpu_dram_gbps = cpu_dram_gbps
        if hasattr(module, "get_device_tflops"):
            module.get_device_tflops = cpu_tflops


_SDPA_CPU_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")


_CPU_SDPA_SEQ_DIM = 2  # q/k/v/out are [batch, heads, sequence, head_dim], the logsumexp [batch, heads, sequence]


def _install_cpu_ring_attention() -> None:
    """Give torch's CP dispatcher the CPU SDPA kernel (module docstring). The handlers go into
    the table ``_enable_cp_dtensor_dispatcher`` copies into DTensor's dispatcher when CP is on
    (torchtitan's ``apply_cp_to_forward``), so outside CP nothing changes."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        cp_attention.custom_ops.setdefault(op, _cpu_ring_attention)


def _cpu_ring_attention(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The CPU SDPA kernel (forward or backward) on q/k/v sharded on the sequence over a 1-D CP
    mesh, as ring attention: each rank keeps its queries and the keys/values travel round the
    CP group (torch's loops, with their head-tail load balancing). Returns DTensors sharded
    like the inputs. An attention mask, or another placement, raises naming it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    schema = op_call._schema
    named = {a.name: v for a, v in zip(schema.arguments, args)} | dict(kwargs)
    placed = [v for v in named.values() if isinstance(v, DTensor)]
    mesh = placed[0].device_mesh
    sharded = (Shard(_CPU_SDPA_SEQ_DIM),)
    bad = [f"{name}: {v.placements}" for name, v in named.items() if isinstance(v, DTensor) and v.placements != sharded]
    if mesh.ndim != 1 or bad:
        raise NotImplementedError(f"CPU ring attention ({op_call}): q/k/v must be sharded on the sequence "
                                  f"(Shard({_CPU_SDPA_SEQ_DIM})) over a 1-D CP mesh, got mesh {mesh} and {bad}")
    if named.get("attn_mask") is not None:
        raise NotImplementedError(f"CPU ring attention ({op_call}): an attn_mask is not supported (causal only)")
    local = {name: v.to_local() if isinstance(v, DTensor) else v for name, v in named.items() if name != "attn_mask"}
    group = mesh.get_group()
    if op_call is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = local.pop("query"), local.pop("key"), local.pop("value")
        results = cp_attention._templated_ring_attention(group, _CPU_SDPA_SEQ_DIM, op_call, q, k, v, **local)
    else:
        results = cp_attention._templated_ring_attention_backward(
            group, _CPU_SDPA_SEQ_DIM, op_call, grad_out_name="grad_out", **local)[:3]
    return tuple(DTensor.from_local(t, mesh, sharded, run_check=False) for t in results)


def save_deterministic_sdpa_pass(gm: torch.fx.GraphModule, example_inputs: Any = None) -> torch.fx.GraphModule:
    """graph_trainer pass (CPU): keep CPU attention out of recompute regions.

    On a GPU the model's attention is FlexAttention, which graph_trainer's memory policy
    recomputes in backward. FlexAttention has no CPU backward, so CPU runs use SDPA, whose
    ATen ops carry the ``nondeterministic_seeded`` tag (they *can* apply dropout) and
    ``selective_activation_remat_pass`` refuses seeded ops inside recompute regions. With
    ``dropout_p == 0`` they are deterministic; this pass checks that and marks them (and the
    ``getitem``s of their outputs) ``MUST_SAVE``, so the remat pass runs on CPU with
    attention outputs saved instead of recomputed. A nonzero dropout is an error: it would
    make recomputation change the numbers.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    targets = {getattr(torch.ops.aten, name).default for name in _SDPA_CPU_OPS}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or "recompute" not in node.meta:
            continue
        dropout = node.kwargs.get("dropout_p", node.args[3] if len(node.args) > 3 else 0.0)
        if dropout:
            raise ValueError(f"CPU attention node {node.name} uses dropout_p={dropout}; it cannot be recomputed")
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for user in node.users:
            if user.target is operator.getitem:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


def activate() -> bool:
    """Apply the runtime shims when no accelerator is present. Idempotent.

    Returns True when the CPU shims are (now) active, False on an accelerator box,
    where only the torch-version gaps (``set_timeout``, the microbatch ``step``) may be
    installed.
    """
    global _active
    _install_set_timeout_alias()
    _install_microbatch_step()
    if accelerator_available():
        return False
    if not _active:
        _install_cpu_roofline()
        _install_cpu_ring_attention()
        import_torchtitan()
        _rebind_device_globals()
        platform_hooks.register_after_fsdp2(after_fsdp2)
        platform_hooks.register_graph_pass_edit(save_attention_before_remat)
        _active = True
    return True


def save_attention_before_remat(passes: list[Callable]) -> list[Callable]:
    """graph_trainer's pass list with :func:`save_deterministic_sdpa_pass` just before
    ``selective_activation_remat_pass`` (registered by :func:`activate` with the integration's
    `platform_hooks`; the list is returned unchanged when it has no remat pass)."""
    names = [(p.func if isinstance(p, functools.partial) else p).__name__ for p in passes]
    if "selective_activation_remat_pass" in names:
        passes.insert(names.index("selective_activation_remat_pass"), save_deterministic_sdpa_pass)
    return passes


def apply_config_defaults(config: Any) -> Any:
    """Config-level CPU choices on a torchtitan ``Trainer.Config`` (in place).

    No-op on an accelerator box. Returns ``config`` for chaining.
    """
    if accelerator_available():
        return config
    config.training.disable_cuda_graphs = True
    compile_config = config.compile
    if hasattr(compile_config, "disable_passes"):
        for name in CPU_DISABLED_GRAPH_PASSES:
            if name not in compile_config.disable_passes:
                compile_config.disable_passes.append(name)
    return config


def after_fsdp2(model: torch.nn.Module) -> None:
    """Force SUM reductions on every FSDP2 module (gloo has no PREMUL_SUM). CPU only."""
    if accelerator_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
