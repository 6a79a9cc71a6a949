"""The convergence study's DDP arms: torch's own DistributedDataParallel, plain (`fp32-ddp`) or
with torch's PowerSGD communication hook (`powersgd-r<R>`), and a count of what the hook sends.

PowerSGD is what a DDP user already has (`torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook`): each gradient matrix M (n x m, a tensor viewed as `shape[0] x rest`) is sent as
two rank-R factors, P = M Q (n x R) and Q = M^T P (m x R), each all-reduced in fp32, with error
feedback and warm start; the tensors its rule does not compress (`_should_compress`: unless
`(n + m) R * min_compression_rate < n m`; vectors always) are all-reduced whole in fp32, and
for the first `start_powerSGD_iter` steps everything is. The arms run the hook itself, unchanged;
`CountedPowerSGD.hook` wraps it only to count, from the tensors of each bucket the hook is handed,
what it will send (torch's own rule decides per tensor), so each run's record carries its bits
per element as sent, cross-checked at the end against the hook's own counters
(`PowerSGDState.total_numel_after_compression`).
"""

# no `from __future__ import annotations` here: DDP's `register_comm_hook` compares the hook's
# annotations with the classes themselves, and would refuse them as strings
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from gift_compile.api import eligible_linears
from gift_compile.config import GiftConfig

__all__ = ["CountedPowerSGD", "ddp_model", "managed_names"]

# torch's default: compress a matrix only where it saves at least half of its elements
MIN_COMPRESSION_RATE = 2


def managed_names(model: nn.Module, world: int) -> list[str]:
    """The weights a GIFT arm with the product's defaults manages (`eligible_linears` at the
    default `min_numel` and exclusions): the set whose elements the frontier's x axis counts, so
    PowerSGD's bits per managed element mean the same elements as GIFT's."""
    config = GiftConfig()
    linears = eligible_linears(model, world, min_numel=config.min_numel, excluded=config.is_excluded, split_rows=False)
    return [name for name, _ in linears]


class CountedPowerSGD:
    """torch's `powerSGD_hook` on `state`, counting the 32-bit elements it sends per parameter.

    Per bucket, before delegating: in the vanilla phase (`state.iter < start_powerSGD_iter`) every
    element of every gradient goes to the all-reduce; after it, each gradient viewed as
    `shape[0] x rest` goes as `(n + m) R` elements where torch's `_should_compress` says so (R
    capped at min(n, m), as the hook caps it), whole otherwise. `bits()` turns the counts into bits
    per element over all steps and over the compressed steps only.
    """

    def __init__(self, model: nn.Module, rank: int, start_iter: int, seed: int, group: dist.ProcessGroup) -> None:
        self.state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start_iter, min_compression_rate=MIN_COMPRESSION_RATE,
                                        use_error_feedback=True, warm_start=True, random_seed=seed)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.numel = {n: p.numel() for n, p in model.named_parameters()}
        self.sent = {"all": defaultdict(int), "compressed": defaultdict(int)}  # phase -> name -> 32-bit elements
        self.compressed: dict[str, tuple[int, int, int]] = {}  # name -> (n, m, R) of the matrices it compressed
        self.counted_after = 0  # the compressed phase's elements, as the hook's own counter should read them
        self.vanilla_buckets = 0
        self.compressed_buckets = 0

    def hook(self, state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook DDP calls per bucket: count, then torch's `powerSGD_hook`."""
        compressing = state.iter >= state.start_powerSGD_iter  # the hook's own test, before it advances
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            name = self.names[id(param)]
            if not compressing:
                self.sent["all"][name] += grad.numel()
                continue
            n = grad.shape[0]
            m = grad.numel() // n
            r = min(n, m, state.matrix_approximation_rank)
            worth, whole, low_rank = psgd._should_compress(n, m, r, state.min_compression_rate)
            sent = low_rank if worth else whole
            if worth:
                self.compressed[name] = (n, m, r)
            self.counted_after += sent
            self.sent["all"][name] += sent
            self.sent["compressed"][name] += sent
        if compressing:
            self.compressed_buckets += 1
        else:
            self.vanilla_buckets += 1
        future = psgd.powerSGD_hook(state, bucket)
        # The hook launches its P and Q all-reduces from future callbacks (gloo's threads): with two
        # buckets in flight, the ranks can enqueue different buckets' collectives in different
        # orders, and gloo pairs them by order (seen here as a size-mismatch abort; equal sizes
        # would be summed silently). Waiting for each bucket's chain keeps one order on every rank;
        # the arithmetic is the hook's, unchanged.
        future.wait()
        return future

    def bits(self, managed: list[str], steps: int) -> dict[str, object]:
        """The record of a run of `steps` steps: bits per managed element (`managed`) and per
        gradient element, over all steps and over the compressed steps; each compressed matrix
        with its counted bits per element and `r (m + n) 32 / (m n)`. Raises where the count
        disagrees with the hook's own counter (the wrapper would have mis-read the hook's rule)."""
        if self.counted_after != self.state.total_numel_after_compression:
            raise RuntimeError(f"PowerSGD bit count: {self.counted_after} elements counted in the compressed steps, "
                               f"the hook's own counter says {self.state.total_numel_after_compression}")
        compressed_steps = steps - self.state.start_powerSGD_iter
        total = sum(self.numel.values())
        m_el = sum(self.numel[n] for n in managed)

        def per_element(phase: str, names: list[str], elements: int, n_steps: int) -> float:
            return 32.0 * sum(self.sent[phase][n] for n in names) / (elements * n_steps) if n_steps > 0 else math.nan

        everything = list(self.numel)
        matrices = {name: {"shape": [n, m], "rank": r,
                           "bits_counted": 32.0 * self.sent["compressed"][name] / (self.numel[name] * compressed_steps),
                           "bits_formula": r * (m + n) * 32.0 / (m * n), "managed": name in managed}
                    for name, (n, m, r) in sorted(self.compressed.items())}
        return {"rank": self.state.matrix_approximation_rank, "start_iter": self.state.start_powerSGD_iter,
                "min_compression_rate": self.state.min_compression_rate, "error_feedback": self.state.use_error_feedback,
                "warm_start": self.state.warm_start, "hook_iter": self.state.iter, "compressed_steps": compressed_steps,
                "vanilla_buckets": self.vanilla_buckets, "compressed_buckets": self.compressed_buckets,
                "bits_managed": per_element("all", managed, m_el, steps),
                "bits_managed_compressed": per_element("compressed", managed, m_el, compressed_steps),
                "bits_whole": per_element("all", everything, total, steps),
                "bits_whole_compressed": per_element("compressed", everything, total, compressed_steps),
                "hook_numel_before": self.state.total_numel_before_compression,
                "hook_numel_after": self.state.total_numel_after_compression,
                "matrices": matrices}


def ddp_model(model: nn.Module, group: dist.ProcessGroup) -> DistributedDataParallel:
    """`model` under torch's DDP with its defaults: the gradients are averaged in the backward by
    DDP's reducer (its default all-reduce, or the registered hook)."""
    return DistributedDataParallel(model, process_group=group)
