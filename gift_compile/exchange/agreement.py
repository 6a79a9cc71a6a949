"""Cross-rank agreement of the eager bucket paths: all ranks check that they run the same plan
before data moves (`check_plan_agreement`), and raise together on what the collective's
headers report (`raise_on_bad_headers`: a plan mismatch, a non-finite gradient). And the
same agreement for a traced backward of GIFT's own sync (`agree_plans`, an op the FX pass
puts before the graph's first exchange).

Split out of `gift_compile.exchange.collectives` because these are host-side checks (small
collectives and Python objects on the process group, a host read), not part of the traceable
core that the FX pass splices into graphs; `collectives` re-exports them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import hashlib
import json

import torch
import torch.distributed as dist

from gift_compile.codec import Nonfinite
from gift_compile.exchange.plan import BucketPlan
from gift_compile.sync import all_reduce_, process_group

__all__ = ["agree_plans", "check_plan_agreement", "first_difference", "graph_plans", "raise_on_bad_headers"]

# The (group, plan fingerprint) pairs whose full description this process has compared, most
# recently used last. Bounded so that a long run with changing plans does not grow it: a pair
# that falls out only costs one more exchange of descriptions the next time it is seen.
MAX_CHECKED_PLANS = 1024
_CHECKED_PLANS: OrderedDict[tuple[str | None, int], None] = OrderedDict()


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two nested descriptions (dicts, lists, values) first differ, as `path: a vs b`:
    the plan check across ranks and `apply`'s check of a second config both name it."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} vs {b!r}"


def _host_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small tensor collective on `group` runs (NCCL needs the current CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def check_plan_agreement(plan: BucketPlan, group: dist.ProcessGroup | None, *, always: bool = False) -> None:
    """Raise on every rank, naming the ranks and the first difference, unless all ranks call
    with the same plan (item names and order included).

    A mismatched all_to_all would hang (different sizes) or decode garbage (same sizes), and a
    check that only some ranks run (because only they meet the plan for the first time) would
    hang against their peers' data collective. So every eager call first exchanges a fixed-size
    table, each rank's plan fingerprint and whether it has compared this plan's full
    description before: one small collective whatever the plans. All ranks read the same
    table, so they all take the same branch: when a fingerprint differs, or some rank meets
    the plan for the first time (or `always`), they exchange the descriptions
    (`all_gather_object`) and raise together on a difference.
    """
    if plan.group_name is None or group is None:
        return
    world, me = dist.get_world_size(group), dist.get_rank(group)
    key = (plan.group_name, plan.fingerprint())
    table = torch.zeros(world, 2, dtype=torch.int64, device=_host_device(group))
    table[me, 0], table[me, 1] = plan.fingerprint(), int(key not in _CHECKED_PLANS or always)
    all_reduce_(table, group)  # keeps the table referenced past gloo's release (`gift_compile.sync`)
    rows = table.tolist()
    differ = [r for r, (fp, _) in enumerate(rows) if fp != plan.fingerprint()]
    if not differ and not any(new for _, new in rows):
        return
    mine = plan.as_dict()
    theirs: list[dict | None] = [None] * world
    dist.all_gather_object(theirs, mine, group=group)
    differ = sorted(set(differ) | {r for r, t in enumerate(theirs) if t != mine})
    if differ:
        r = differ[0]
        raise RuntimeError(
            f"GIFT: ranks disagree on a collective's plan: rank(s) {differ} differ from rank {me}; first "
            f"difference: {first_difference(mine, theirs[r])} (this rank vs rank {r}).\n  this rank: "
            f"{plan.describe()}\n  rank {r}: {BucketPlan.from_dict(theirs[r]).describe() if theirs[r] else None}"
        )
    _remember_checked(key)


def _remember_checked(key: tuple[str | None, int]) -> None:
    """Mark `key` as compared, most recently; the least recently used past the bound fall out."""
    _CHECKED_PLANS[key] = None
    _CHECKED_PLANS.move_to_end(key)
    while len(_CHECKED_PLANS) > MAX_CHECKED_PLANS:
        _CHECKED_PLANS.popitem(last=False)


def raise_on_bad_headers(headers: torch.Tensor, plan: BucketPlan, nonfinite_policy: Nonfinite) -> None:
    """Eager callers: raise on every rank (all read the same headers) for a plan mismatch, or
    for a non-finite gradient under `nonfinite="error"`, naming the offending ranks."""
    fps, flags = headers[:, 0].tolist(), headers[:, 1].tolist()
    differ = [r for r, f in enumerate(fps) if f != plan.fingerprint()]
    if differ:
        raise RuntimeError(f"GIFT: rank(s) {differ} ran a different collective plan than {plan.describe()}")
    bad = [r for r, f in enumerate(flags) if f]
    if bad and nonfinite_policy is Nonfinite.ERROR:
        names = ", ".join(i.name for i in plan.items)
        raise FloatingPointError(
            f"GIFT: non-finite (NaN/Inf) gradient on rank(s) {bad} in {names}; raised on every rank "
            "(nonfinite='error'). Set nonfinite='propagate' to communicate NaN rows instead."
        )


def graph_plans(plans: list[BucketPlan]) -> tuple[int, str]:
    """The fingerprint (signed 64-bit) and the description (JSON) of a traced backward's
    buckets in the order it runs them: what `agree_plans` compares across ranks."""
    text = json.dumps([p.as_dict() for p in plans], sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True), text


@torch.library.custom_op("gift::agree_plans", mutates_args=("counters",))
def agree_plans(counters: torch.Tensor, group_name: str, fingerprint: int, plans: str) -> None:
    """Raise on every rank, naming the ranks and the first difference, unless every rank's
    traced backward runs the same GIFT buckets (`graph_plans` of them: `fingerprint`,
    `plans`), before any of them exchanges data.

    Why: a compiled backward's collectives are fixed in its graph. A managed layer that one
    rank ran in a step and another did not (a branch, a layer skipped on some batches) gives
    the ranks graphs with different buckets, whose collectives pair with the wrong peers: gloo
    aborts the process ("collective mismatch") or waits for the group's timeout. The eager
    calls agree on each bucket's plan first (`check_plan_agreement`); a graph agrees once, on
    all of its plans, through one `[world]` int64 all-reduce and a host read (the plain
    path's end-of-backward sync reads the host anyway), then the descriptions only when the
    fingerprints differ. Every rank reads the same table, so all raise, or none, before the
    first exchange; nothing has been sent or counted, so a caught error leaves the group in
    step for the next backward.

    `counters` (the state's, which every exchange of the graph updates) is declared mutated
    though it is not written: that keeps the op in the graph (an op without outputs would be
    dead code) and orders it before the exchanges, which read and update the counters after it.
    """
    group = process_group(group_name)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, dtype=torch.int64, device=_host_device(group))
    table[me] = fingerprint
    all_reduce_(table, group)
    differ = [r for r, fp in enumerate(table.tolist()) if fp != fingerprint]
    if not differ:
        return
    theirs: list[str | None] = [None] * world
    dist.all_gather_object(theirs, plans, group=group)
    r = differ[0]
    mine, other = json.loads(plans), json.loads(theirs[r] or "[]")
    raise RuntimeError(
        f"GIFT: ranks disagree on the compiled backward's plan: rank(s) {differ} differ from rank {me}; first "
        f"difference: {first_difference({'buckets': mine}, {'buckets': other})} (this rank vs rank {r}). Every rank "
        "must run the same managed layers in each compiled step (a layer used on some ranks only, or in another "
        "order, gives the ranks different collectives); raised on every rank before any gradient was sent.\n"
        f"  this rank: {'; '.join(BucketPlan.from_dict(p).describe() for p in mine)}\n"
        f"  rank {r}: {'; '.join(BucketPlan.from_dict(p).describe() for p in other)}"
    )


@agree_plans.register_fake
def _agree_plans_fake(counters: torch.Tensor, group_name: str, fingerprint: int, plans: str) -> None:
    return None
