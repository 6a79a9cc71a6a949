"""End to end: a small Llama trained 50 steps on 2 gloo ranks with GIFT FP8 (compiled)
tracks the same run with exact fp32 gradient communication (eager all-reduce)."""

import torch
import torch.distributed as dist

import gift_compile
from gift_compile import corpus
from gift_compile.tiny_llama import TinyLlama, TinyLlamaConfig, loss
from multirank import run_ranks

STEPS = 50


def _train(rank: int, world: int, use_gift: bool) -> list[float]:
    tokens = corpus.token_stream("train", corpus.prepare())
    model = TinyLlama(TinyLlamaConfig.tiny(), seed=0)
    if use_gift:
        cfg = gift_compile.GiftConfig(format="fp8_e4m3", geometry="lowrank", rank=16, refresh_every=10)
        gift_compile.apply(model, cfg)
        step_model = torch.compile(model, fullgraph=True, dynamic=False)
    else:
        step_model = model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for inputs, labels in corpus.batches(tokens, 8, 64, seed=0, rank=rank, world_size=world, steps=STEPS):
        value = loss(step_model(inputs), labels)
        value.backward()
        if not use_gift:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad()
        reduced = value.detach().clone()
        dist.all_reduce(reduced)
        losses.append(float(reduced) / world)
    return losses


def test_gift_fp8_tracks_fp32_communication():
    gift = run_ranks(_train, 2, True)[0]
    exact = run_ranks(_train, 2, False)[0]
    assert len(gift) == len(exact) == STEPS
    assert exact[-1] < exact[0] - 1.0, "the baseline must actually learn"
    tail_gift = sum(gift[-10:]) / 10
    tail_exact = sum(exact[-10:]) / 10
    assert abs(tail_gift - tail_exact) / tail_exact < 0.02, (tail_gift, tail_exact)
