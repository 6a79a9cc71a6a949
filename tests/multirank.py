"""Run a function on N gloo ranks in subprocesses and collect what each returns.

Tests that need real collectives use this instead of torchrun: each rank is a process
sharing a FileStore, so a failure on any rank fails the test with its traceback.

Ranks are forked from one forkserver per pytest process whose interpreter has already imported
torch and gift_compile (`_PRELOAD`): a `spawn`ed rank pays ~3 s to import them again, so a suite
of ~80 multi-rank tests spent ~4 minutes starting processes; a forked one starts in ~0.1 s. The
forkserver is itself a fresh interpreter (started once, without the parent's threads), so a
rank never inherits the test runner's state: what a rank needs it gets through `fn`'s args.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            buf = io.BytesIO()
            torch.save(fn(rank, world, *args), buf)  # bytes, not shared-memory handles
            queue.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))


# What the forkserver imports once, before it forks any rank.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "gift_compile",
            "gift_compile.passes"]


def _context() -> Any:
    """The forkserver context, its preload set the first time (it applies when the server starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """`[fn(rank, world, *args) for each rank]`, run concurrently on a gloo group.

    `fn` must be a module-level function (it is pickled) and return picklable values
    (tensors are fine).
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store_path, fn, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world and not errors:
                try:
                    rank, status, value = queue.get(timeout=1.0)
                except queue_mod.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        errors.append(f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                    elif time.monotonic() > deadline:
                        errors.append(f"timed out after {timeout:.0f} s")
                    continue
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=5 if errors else timeout)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("multi-rank test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
