"""The reference model and the real gradients every fidelity number is measured on.

Quantization error depends on the gradient's statistics (heavy tails, row-norm spread, the
anisotropy of the layer inputs), which random matrices do not have and which change as a
model trains. So the bench trains a small Llama on the Shakespeare corpus itself, for a fixed
budget, caches it next to the corpus (keyed by every training setting, so a change retrains
instead of reusing a stale model), and then back-propagates held-out batches through it.

For each managed linear weight and held-out batch it keeps the batch gradient, the
per-micro-batch gradients (the simulated ranks of the multi-rank experiment), the K-FAC input
factor `A = E[x x^T]` of this batch (the metric) and of the previous batch (what GIFT, which
refreshes from past statistics, would whiten with), and the gradient-side factor of the
previous batch's gradient.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.optim import _muon

from bench.lib.settings import FidelitySettings, ReferenceSettings
from gift_compile.torchtitan_ext.cpu import corpus, language_modeling
from gift_compile.config import GiftConfig
from gift_compile.geometry import gradient_factor
from bench.lib.tiny_llama import TinyLlama, loss

Log = Callable[[str], None]
_HELDOUT_SEED = 1234


@dataclass
class LayerSample:
    """One managed weight on one held-out batch (all tensors fp32, CPU)."""

    name: str
    batch: int
    grad: torch.Tensor  # [out, in], gradient of the batch's mean loss
    micro: torch.Tensor | None  # [micro_batches, out, in] or None (kept for multi-rank batches only)
    a_prev: torch.Tensor  # [in, in], K-FAC factor of the previous batch
    a_cur: torch.Tensor  # [in, in], K-FAC factor of this batch
    g_prev: torch.Tensor  # [in, in], gradient-side factor of the previous batch's gradient
    # the factor `clip_grad_norm_(params, 1.0)` would scale this batch's gradient by (all parameters)
    clip: float = 1.0
    # [2, out, in]: the mean gradients of the batch's two halves (two simulated ranks; their mean
    # is `grad`), kept when `FidelitySettings.keep_halves`
    halves: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.grad.shape[0]), int(self.grad.shape[1]))


def managed_linears(model: nn.Module, config: GiftConfig | None = None) -> dict[str, nn.Linear]:
    """Linear layers whose weights `gift_compile.apply` would manage under `config`'s rules."""
    config = config or GiftConfig()
    out = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            name = f"{fqn}.weight"
            if mod.weight.numel() >= config.min_numel and not config.is_excluded(name):
                out[name] = mod
    return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of `peak` (the usual LLM pretraining schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
               optimizers: list[torch.optim.Optimizer], peaks: list[float], step: int, total: int, warmup: int,
               x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None] | None = None) -> torch.Tensor:
    """One step of the bench's pretraining recipe, shared by the reference model and every
    convergence arm so that they differ only in `sync`: schedule (`lr_at`) per optimizer, loss,
    backward, `sync()` (the gradient communication; None on one process), clipping to norm 1,
    then the optimizers' steps in reverse order (the first optimizer, which drives GIFT's
    state, steps last: its post-hook ends the step). Returns the step's (local) loss."""
    for opt, peak in zip(optimizers, peaks):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, peak, warmup)
    value = loss(forward(x), y)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    value.backward()
    if sync is not None:
        sync()
    nn.utils.clip_grad_norm_(params, 1.0)
    for opt in reversed(optimizers):
        opt.step()
    return value.detach()


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalization, step for step, in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.t()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.t()
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.t() if tall else x


class Fp32Muon(torch.optim.Muon):
    """`torch.optim.Muon` whose Newton-Schulz iteration runs in fp32 rather than bf16.

    On CPU, bf16 matmuls are emulated: torch's Muon step on the small Llama's 28 hidden
    matrices takes ~4.4 s here against ~0.24 s in fp32 (18x), which would make every Muon run
    of the bench ~10x slower than its forward and backward. The iteration, coefficients, step
    count, momentum and learning-rate rules are torch's; only the working precision of the
    orthogonalization is higher (bf16 rounding, ~4e-3 relative, is then absent from the
    optimizer's own noise). The swap of torch's module-level function lasts only for this
    optimizer's step.
    """

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        original = _muon._zeropower_via_newtonschulz
        _muon._zeropower_via_newtonschulz = _newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            _muon._zeropower_via_newtonschulz = original


def make_optimizers(model: nn.Module, name: str, lr: float, muon_lr: float) -> tuple[list[torch.optim.Optimizer], list[float]]:
    """The optimizers of one training run and their peak learning rates (schedules scale them).

    "adamw": AdamW on everything. "muon": `torch.optim.Muon` (`adjust_lr_fn="match_rms_adamw"`,
    so `muon_lr` is on AdamW's scale; `Fp32Muon` when the parameters live on the CPU) on the
    hidden 2-D matrices (`layers.*`), AdamW on embeddings, norms and head: the paper's setting. With GIFT, drive its state from the
    first optimizer (`gift_compile.apply(..., optimizer=optimizers[0])`) and step it last.
    """
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)], [lr]
    if name != "muon":
        raise ValueError(f"unknown optimizer {name!r}; allowed: muon, adamw")
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    muon_cls = Fp32Muon if all(p.device.type == "cpu" for p in hidden) else torch.optim.Muon
    muon = muon_cls(hidden, lr=muon_lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return [muon, adamw], [muon_lr, lr]


def cache_path(settings: ReferenceSettings, paths: corpus.CorpusPaths, cache_dir: Path | None) -> Path:
    fields = dataclasses.asdict(settings)
    if fields["optimizer"] == "adamw":  # AdamW models keep the cache key they had before Muon existed
        del fields["optimizer"], fields["muon_lr"]
    key = json.dumps(fields, sort_keys=True) + corpus.CORPUS_VERSION
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = cache_dir if cache_dir is not None else paths.root / "bench"
    return root / f"reference-{digest}.pt"


def reference_model(
    settings: ReferenceSettings, paths: corpus.CorpusPaths, log: Log, cache_dir: Path | None = None
) -> tuple[TinyLlama, dict[str, object]]:
    """The trained reference model and its training record (from the cache when present)."""
    path = cache_path(settings, paths, cache_dir)
    model = TinyLlama(settings.model, seed=settings.seed)
    if path.is_file():
        blob = torch.load(path, weights_only=False)
        model.load_state_dict(blob["state_dict"])
        log(f"reference model loaded from cache {path}")
        return model, blob["record"]
    log(f"training the reference model ({settings.optimizer}, {settings.steps} steps of {settings.batch_size}x{settings.seq_len} "
        f"tokens); cached afterwards at {path}")
    record, opt_state = _train(model, settings, paths, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    torch.save({"state_dict": model.state_dict(), "record": record, "optimizer_state": opt_state}, tmp)
    os.replace(tmp, path)
    return model, record


def optimizer_state(settings: ReferenceSettings, paths: corpus.CorpusPaths,
                    cache_dir: Path | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state the cached reference model ended its training with, per managed
    linear weight (AdamW: `exp_avg`, `exp_avg_sq`, `step`; Muon: `momentum_buffer`): what the
    sweep's AdamW-update metric and the second-moment candidates start from. Raises when the
    cache predates the saved state (delete the file named to retrain)."""
    path = cache_path(settings, paths, cache_dir)
    blob = torch.load(path, weights_only=False)
    if "optimizer_state" not in blob:
        raise RuntimeError(f"reference cache {path} was written without its optimizer state; delete it to retrain")
    return blob["optimizer_state"]


def _train(model: TinyLlama, s: ReferenceSettings, paths: corpus.CorpusPaths,
           log: Log) -> tuple[dict[str, object], dict[str, dict[str, torch.Tensor]]]:
    """Train `model` in place; returns its training record and the final optimizer state of
    every managed linear weight (`optimizer_state`)."""
    tokens = corpus.token_stream("train", paths)
    optimizers, peaks = make_optimizers(model, s.optimizer, s.lr, s.muon_lr)
    losses: list[float] = []
    start = time.perf_counter()
    params = list(model.parameters())
    for step, (x, y) in enumerate(language_modeling.batches(tokens, s.batch_size, s.seq_len, seed=s.seed, steps=s.steps)):
        value = train_step(model, params, optimizers, peaks, step, s.steps, s.warmup, x, y)
        losses.append(float(value))
        if (step + 1) % max(1, s.steps // 8) == 0 or step + 1 == s.steps:
            log(f"  reference step {step + 1}/{s.steps} loss {value.item():.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    bpb = language_modeling.bits_per_byte(model, "val", paths, seq_len=s.seq_len, max_tokens=16384)
    log(f"  reference model: held-out bits/byte {bpb:.4f}")
    state = {}
    for name, mod in managed_linears(model).items():
        owner = next(o for o in optimizers if mod.weight in o.state)
        state[name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in owner.state[mod.weight].items()}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": s.steps * s.batch_size * s.seq_len,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "val_bpb": bpb,
        "seconds": time.perf_counter() - start,
        "losses": losses,
    }, state


def collect_samples(model: TinyLlama, s: FidelitySettings, paths: corpus.CorpusPaths, log: Log) -> list[LayerSample]:
    """Gradients and factors of `s.heldout_batches` held-out (validation-split) batches.

    Each batch has `s.micro_batches` sequences, back-propagated one at a time: the batch
    gradient is the mean of the micro-batch gradients (every sequence has the same number of
    tokens), so both come from the same passes. Batch 0 only supplies factors.
    """
    linears = managed_linears(model)
    val = corpus.token_stream("val", paths)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook_for(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    handles = [mod.register_forward_pre_hook(hook_for(name)) for name, mod in linears.items()]
    model.train()
    samples: list[LayerSample] = []
    prev_a: dict[str, torch.Tensor] = {}
    prev_g: dict[str, torch.Tensor] = {}
    try:
        batches = language_modeling.batches(val, s.micro_batches, s.seq_len, seed=_HELDOUT_SEED, steps=s.heldout_batches + 1)
        for b, (x, y) in enumerate(batches):
            sums.clear()
            counts.clear()
            micro = {name: torch.empty(s.micro_batches, *mod.weight.shape) for name, mod in linears.items()}
            total = [torch.zeros_like(p) for p in model.parameters()]  # batch gradient of every parameter
            for i in range(s.micro_batches):
                model.zero_grad(set_to_none=True)
                loss(model(x[i:i + 1]), y[i:i + 1]).backward()
                for name, mod in linears.items():
                    micro[name][i] = mod.weight.grad
                for acc, p in zip(total, model.parameters()):
                    if p.grad is not None:
                        acc += p.grad
            norm = float(torch.stack([(acc / s.micro_batches).norm() for acc in total]).norm())
            clip = min(1.0, 1.0 / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient at max_norm 1
            half = s.micro_batches // 2
            keep_micro = 1 <= b <= s.multirank_batches
            for name in linears:
                grad = micro[name].mean(dim=0)
                a_cur = (sums[name] / counts[name]).float()
                if b > 0:
                    halves = (torch.stack([micro[name][:half].mean(dim=0), micro[name][half:].mean(dim=0)])
                              if s.keep_halves else None)
                    samples.append(LayerSample(name, b, grad, micro[name] if keep_micro else None,
                                               prev_a[name], a_cur, prev_g[name], clip, halves))
                prev_a[name], prev_g[name] = a_cur, gradient_factor(grad)
            log(f"  held-out batch {b}/{s.heldout_batches}: {s.micro_batches} micro-batches back-propagated")
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return samples


def reference_samples(reference: ReferenceSettings, fidelity: FidelitySettings, cache_dir: Path | None,
                      log: Log) -> list[LayerSample]:
    """The held-out gradient samples of the reference model (`collect_samples`), the model
    trained or read from `cache_dir` first: what the per-layer benches measure on."""
    paths = corpus.prepare()
    model, _ = reference_model(reference, paths, log, cache_dir)
    return collect_samples(model, fidelity, paths, log)
