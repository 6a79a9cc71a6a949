"""Compiled per-item codec bodies: one `torch.compile(fullgraph=True)` function per (stage, item plan).

The eager entry point of a bucket (`exchange.run_bucket(..., compiled=True)`, which FSDP2's,
DDP's and HSDP's hooks and the one-tensor API use) runs the codec of each item through a body
compiled for that item's plan alone (`item_codec.item_plan`: shape, dtype, format, map,
flags, world, op, average; the name only where a seed reads it). A bucket's own plan is the
pattern of its items, which differs from block to block when a selection puts different
layers of different blocks on the transformed path, and changes when a refresh re-selects; the
item plans are the few (shape, path) combinations of a model. Compiling per item bounds the
compilations by those combinations, not by depth or by the number of patterns a run goes
through (issue 31: compiled per bucket, the 9th pattern hit dynamo's `recompile_limit` and
killed the run).

Why a cache of our own with a fresh code object per key, rather than one compiled function
that recompiles per key (or a raised `recompile_limit`): dynamo counts compilations per code
object (`recompile_limit`, 8) and caps the entries of any one code object
(`accumulated_recompile_limit`, 256); every guard set of a function is checked on each call,
in order, so a function with many keys also gets slower to call. Each key here gets a
function of its own (`_fresh`: the stage's trampoline with a copied code object), so dynamo
sees every body exactly once: no limit of dynamo's can be reached whatever number of keys a
process sees, the guards of a call are those of one key, and nothing depends on patching
dynamo's global config (which a user's own `torch.compile` shares).

The bound is ours and explicit: at most `MAX_BODIES` live bodies. A model has a handful of
item plans per stage (a Llama block: 7 linear shapes x 2 paths, a few passthrough sizes; an
all-reduce has 3 stages, a reduce-scatter 2), so the bound holds several models' worth.
Past it the least recently used body is dropped (its code object, and with it dynamo's cache
entry, is freed) and the eviction is logged once per process with its reason: a run that
cycles through more keys recompiles, it never dies.
"""

from __future__ import annotations

import logging
import time
import types
from collections import OrderedDict
from typing import Callable

import torch

from gift_compile.exchange.plan import BucketPlan

logger = logging.getLogger("gift_compile")

__all__ = ["MAX_BODIES", "body", "live_item_plans", "set_max_bodies", "stats"]

MAX_BODIES = 256

_bodies: OrderedDict[tuple[str, BucketPlan], tuple[Callable[..., object], types.CodeType]] = OrderedDict()
_created = 0
_evicted = 0
_evicted_graphs = 0
_evicted_recompiles = 0
_warned_eviction = False
# When the last body was created (monotonic seconds): bodies created less than `_BURST_S`
# apart belong to one step's compilation, announced once when it starts.
_last_created = -1e9
_BURST_S = 30.0


def _entries(code: types.CodeType) -> int:
    """Dynamo's compiled entries of one code object (1 once a body has run; more would be
    recompilations: the tests check there are none)."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


def _fresh(stage: str, fn: Callable[..., object], key: BucketPlan) -> tuple[Callable[..., object], types.CodeType]:
    """`fn(*args, key)` as a function with a code object of its own (dynamo keys its cache,
    and counts recompilations, per code object). The plan is a closure constant, not an
    argument, so dynamo guards no plan field."""

    def trampoline(*args: object) -> object:
        return fn(*args, key)

    code = trampoline.__code__.replace(co_name=f"gift_{stage}")
    assert code is not trampoline.__code__
    return types.FunctionType(code, trampoline.__globals__, code.co_name, None, trampoline.__closure__), code


def body(stage: str, fn: Callable[..., object], key: BucketPlan) -> Callable[..., object]:
    """The compiled body of `fn` (an `item_codec` stage taking the plan last) for item plan
    `key`; compiled on first use, kept up to `MAX_BODIES` (least recently used dropped past it,
    logged once)."""
    global _created, _evicted, _evicted_graphs, _evicted_recompiles, _warned_eviction
    k = (stage, key)
    hit = _bodies.get(k)
    if hit is not None:
        _bodies.move_to_end(k)
        return hit[0]
    global _last_created
    now = time.monotonic()
    if now - _last_created > _BURST_S:  # the first body of a burst: the step stalls while they compile
        logger.info("GIFT: compiling the codec's bodies (%s of %s, and the others this step uses: once per layer "
                    "shape, stage and path; on a CPU this step stalls for a minute or two, again at the step after "
                    "the first refresh, whose mapped path is new)", stage, key.items[0].describe())
    _last_created = now
    f, code = _fresh(stage, fn, key)
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    _bodies[k] = (compiled, code)
    _created += 1
    while len(_bodies) > MAX_BODIES:
        (old_stage, old_key), (_, old_code) = _bodies.popitem(last=False)
        n = _entries(old_code)
        _evicted += 1
        _evicted_graphs += n
        _evicted_recompiles += max(0, n - 1)
        if not _warned_eviction:
            _warned_eviction = True
            logger.warning("GIFT: more than %d compiled codec bodies (distinct item plans x stages) in this process; "
                           "dropping the least recently used (%s of %s), which recompiles if it is used again. "
                           "Raise the bound with gift_compile.exchange.compiled_bodies.set_max_bodies (logged once)",
                           MAX_BODIES, old_stage, old_key.items[0].describe())
    return compiled


def set_max_bodies(n: int) -> None:
    """Change the bound on live compiled bodies (bodies past it are dropped at the next miss)."""
    global MAX_BODIES
    if n < 1:
        raise ValueError(f"set_max_bodies: n={n}; need at least 1")
    MAX_BODIES = n


def stats() -> dict[str, int]:
    """Compilation telemetry of this process: `bodies` (compiled bodies created, cumulative),
    `live` (kept now), `evicted`, `graphs` (dynamo compilations of them: live entries plus
    those of evicted bodies) and `recompiles` (compilations past a body's first; 0 unless
    something in a body's inputs varies that its key does not fix)."""
    live = [_entries(code) for _, code in _bodies.values()]
    return {"bodies": _created, "live": len(_bodies), "evicted": _evicted, "graphs": sum(live) + _evicted_graphs,
            "recompiles": sum(max(0, n - 1) for n in live) + _evicted_recompiles}


def live_item_plans() -> int:
    """Distinct item plans among the live bodies (any stage)."""
    return len({key for _, key in _bodies})
