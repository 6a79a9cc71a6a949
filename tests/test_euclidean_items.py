"""`frameworks.euclidean.euclidean_plan`: how a parameter group on another mesh than GIFT's
(torchtitan's routed experts on ``efsdp``) is cut into GIFT items, without torchtitan or ranks
(the 4-rank runs are tests/test_torchtitan_ep*.py). The gradient a collective reduces over
`world` ranks, a grouped expert weight `[experts, out, in]`, is one item `[experts x out, in]` at
the state's format (or its `layer_formats` entry), with no map and none of a layer's runtime
tensors, and error feedback where the caller keeps a residual for it, which the state then
checkpoints. The same rule carries every gradient outside the layers (embedding, head, norms):
tiny ones at `tiny_format`, the rest at `unmapped_format`; raw (None) only where the config
opts out."""

from __future__ import annotations

import pytest

import torch

from gift_compile.codec import residual as residual_store
from gift_compile.config import GiftConfig, GiftConfigError
from gift_compile.exchange.plan import Collective
from gift_compile.frameworks.euclidean import euclidean_plan
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.state import GiftState


@pytest.fixture(scope="module")
def state() -> GiftState:
    config = GiftConfig(format="nvfp4", geometry="lowrank", error_feedback=True, stochastic_rounding=True,
                        min_numel=4096, layer_formats=("*w2_EDF=fp8_e4m3",))
    return GiftState(config, None, collective=Collective.REDUCE_SCATTER)


def test_a_grouped_expert_weight_is_one_item_of_its_experts_rows(state: GiftState) -> None:
    plan = euclidean_plan(state, "blocks.1.experts.w1_EFD", (4, 64, 32), world=2)
    assert plan is not None and plan.managed
    # 4 experts x 64 rows each (2 whole experts per rank), the input dim as columns
    assert (plan.rows, plan.cols) == (256, 32)
    assert plan.name == "blocks.1.experts.w1_EFD"
    assert plan.format == "nvfp4" and plan.kind == IDENTITY_KIND and plan.n_tensors == 0
    # no layer here: no gate, no second hop, and no residual unless the caller keeps one; the
    # codec's own options stay
    assert not plan.error_feedback and not plan.second_hop_error_feedback and not plan.gated
    assert plan.stochastic_rounding
    # a 2-D parameter sharded on dim 0 is its own rows
    flat = euclidean_plan(state, "blocks.1.router.w", (96, 128), world=2)
    assert flat is not None and (flat.rows, flat.cols) == (96, 128)


def test_layer_formats_apply_to_the_expert_items(state: GiftState) -> None:
    plan = euclidean_plan(state, "blocks.1.experts.w2_EDF", (4, 32, 64), world=2)
    assert plan is not None and plan.format == "fp8_e4m3"


@pytest.mark.parametrize("shape, name, expected, logged, why", [
    ((2048,), "blocks.1.experts.bias", ("bf16", 2048, 1), False, "one dim: tiny, at tiny_format"),
    ((2, 32, 32), "blocks.1.experts.w1_EFD", ("bf16", 2048, 1), False, "2048 elements, under min_numel 4096: tiny"),
    ((3, 64, 32), "blocks.1.experts.w1_EFD", ("bf16", 6144, 1), True, "3 experts do not split over 2 ranks"),
    ((4, 64, 32), "tok_embeddings.w", ("bf16", 256, 32), False, "excluded from the map: at excluded_format"),
    ((4, 64, 32), "blocks.1.experts.w1_EFD", ("nvfp4", 256, 32), False, "not excluded: at unmapped_format (format)"),
    ((4096, 2), "blocks.1.experts.narrow", ("bf16", 8192, 1), True, "2 columns in a 16-element block: codes cost more"),
])
def test_what_cannot_go_as_codes_goes_at_tiny_format(state: GiftState, shape: tuple[int, ...], name: str,
                                                    expected: tuple[str, int, int], logged: bool, why: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The one rule for gradients outside the layers: every gradient crosses in a low-bit or
    16-bit format; tiny ones (and those codes cannot carry) as a `[numel, 1]` bf16 item, with no
    error feedback (the 16-bit rounding is below the codes' noise); a fallback from the
    configured format is logged naming the parameter."""
    with caplog.at_level("WARNING", logger="gift_compile"):
        plan = euclidean_plan(state, name, shape, world=2, error_feedback=True)
    assert plan is not None and (plan.format, plan.rows, plan.cols) == expected, why
    assert plan.kind == IDENTITY_KIND and plan.n_tensors == 0
    assert plan.error_feedback == (plan.format != "bf16") and not plan.block_rotation
    assert (name in caplog.text) == logged, caplog.text


def test_a_shard_on_another_dim_goes_raw(state: GiftState) -> None:
    # FSDP2 passes no shape for a parameter sharded on another dim than 0: no rows to split
    assert euclidean_plan(state, "blocks.1.experts.w1_EFD", (), world=2) is None


@pytest.mark.parametrize("opt_out", ["unmapped_format", "excluded_format", "tiny_format"])
def test_the_opt_outs_send_their_class_raw(opt_out: str) -> None:
    config = GiftConfig(format="int2", block_size=32, geometry="lowrank", min_numel=4096, **{opt_out: "fp32"})
    st = GiftState(config, None, collective=Collective.REDUCE_SCATTER)
    plans = {"unmapped_format": euclidean_plan(st, "layers.0.tied.weight", (4096, 64), world=2),
             "excluded_format": euclidean_plan(st, "tok_embeddings.weight", (4096, 64), world=2),
             "tiny_format": euclidean_plan(st, "norm.weight", (64,), world=2)}
    assert {field for field, plan in plans.items() if plan is None} == {opt_out}
    defaults = {"unmapped_format": "int2", "excluded_format": "bf16", "tiny_format": "bf16"}
    assert all(plan.format == defaults[field] for field, plan in plans.items() if plan is not None)


@pytest.mark.parametrize("field, value, allowed", [
    ("unmapped_format", "int7", "fp32: the opt-out"), ("unmapped_format", 2, "same"),
    ("excluded_format", "int7", "fp32: the opt-out"),
    ("tiny_format", "int2", "bf16, fp32"), ("tiny_format", "same", "bf16, fp32"),
])
def test_the_formats_outside_the_layers_are_validated(field: str, value: object, allowed: str) -> None:
    with pytest.raises(GiftConfigError, match=allowed) as err:
        GiftConfig(**{field: value})
    assert err.value.field == field


def test_error_feedback_where_the_caller_keeps_the_residual(state: GiftState) -> None:
    plan = euclidean_plan(state, "blocks.1.experts.w1_EFD", (4, 64, 32), world=2, error_feedback=True)
    assert plan is not None and plan.error_feedback and not plan.second_hop_error_feedback
    assert plan.residual_format == state.config.residual_format
    # the config decides: without error feedback there, none here either
    off = GiftState(GiftConfig(geometry="lowrank", format="nvfp4", min_numel=4096), None, collective=Collective.REDUCE_SCATTER)
    plan = euclidean_plan(off, "blocks.1.experts.w1_EFD", (4, 64, 32), world=2, error_feedback=True)
    assert plan is not None and not plan.error_feedback


def _with_residual(config: GiftConfig, shape: tuple[int, int] = (256, 32)) -> GiftState:
    state = GiftState(config, None, collective=Collective.REDUCE_SCATTER)
    state.add_outside_residual("blocks.1.experts.w1_EFD", shape, "cpu")
    return state


def test_the_state_checkpoints_the_residuals_it_keeps_for_them() -> None:
    config = GiftConfig(geometry="lowrank", format="nvfp4", error_feedback=True)
    saved = _with_residual(config)
    (buf,) = saved.outside["blocks.1.experts.w1_EFD"].buffers
    buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    sd = saved.state_dict()
    assert torch.equal(sd["outside:blocks.1.experts.w1_EFD.0"], buf)
    assert saved.memory_bytes()["residuals"] == buf.numel() * 4
    loaded = _with_residual(config)
    loaded.load_state_dict(sd)
    assert torch.equal(loaded.outside["blocks.1.experts.w1_EFD"].buffers[0], buf)
    # stored in another residual format: re-stored from the saved values
    recoded = _with_residual(GiftConfig(geometry="lowrank", format="nvfp4", error_feedback=True, residual_format="fp8_e4m3"))
    recoded.load_state_dict(sd)
    got = recoded.outside["blocks.1.experts.w1_EFD"]
    value = residual_store.read("fp8_e4m3", got.buffers, 32)
    assert 0 < float((value - buf).norm() / buf.norm()) < 0.1
    # a checkpoint without it (error feedback newly on): starts at zero
    fresh = _with_residual(config)
    fresh.load_state_dict(GiftState(GiftConfig(geometry="lowrank", format="nvfp4"), None, collective=Collective.REDUCE_SCATTER)
                          .state_dict())
    assert not fresh.outside["blocks.1.experts.w1_EFD"].buffers[0].any()


@pytest.mark.parametrize("into, match", [
    (GiftConfig(geometry="lowrank", format="nvfp4"), "error_feedback is off now"),
    (GiftConfig(geometry="lowrank", format="nvfp4", error_feedback=True, residual_format="fp32"), "residual shape"),
])
def test_a_residual_that_does_not_fit_is_refused(into: GiftConfig, match: str) -> None:
    sd = _with_residual(GiftConfig(geometry="lowrank", format="nvfp4", error_feedback=True)).state_dict()
    state = (GiftState(into, None, collective=Collective.REDUCE_SCATTER) if not into.error_feedback
             else _with_residual(into, shape=(128, 32)))
    with pytest.raises(ValueError, match=match):
        state.load_state_dict(sd)


def test_a_non_finite_residual_is_refused() -> None:
    config = GiftConfig(geometry="lowrank", format="nvfp4", error_feedback=True)
    sd = _with_residual(config).state_dict()
    sd["outside:blocks.1.experts.w1_EFD.0"][0, 0] = float("nan")
    state = _with_residual(config)
    with pytest.raises(ValueError, match="NaN/Inf"):
        state.load_state_dict(sd)
    assert not state.outside["blocks.1.experts.w1_EFD"].buffers[0].any()  # validated before anything changed
