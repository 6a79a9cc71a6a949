"""`frameworks.euclidean.euclidean_plan`: how a parameter group on another mesh than GIFT's
(torchtitan's routed experts on ``efsdp``) is cut into GIFT items, without torchtitan or ranks
(the 4-rank runs are tests/test_torchtitan_ep*.py). The gradient a collective reduces over
`world` ranks, a grouped expert weight `[experts, out, in]`, is one item `[experts x out, in]` at
the state's format (or its `layer_formats` entry), with no map and none of a layer's runtime
tensors; anything else goes raw (None)."""

from __future__ import annotations

import pytest

from gift_compile.config import GiftConfig
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
    # no layer here: no residual (error feedback off whatever the config), no gate; the codec's own
    # options stay
    assert not plan.error_feedback and not plan.second_hop_error_feedback and not plan.gated
    assert plan.stochastic_rounding
    # a 2-D parameter sharded on dim 0 is its own rows
    flat = euclidean_plan(state, "blocks.1.router.w", (96, 128), world=2)
    assert flat is not None and (flat.rows, flat.cols) == (96, 128)


def test_layer_formats_apply_to_the_expert_items(state: GiftState) -> None:
    plan = euclidean_plan(state, "blocks.1.experts.w2_EDF", (4, 32, 64), world=2)
    assert plan is not None and plan.format == "fp8_e4m3"


@pytest.mark.parametrize("shape, name, why", [
    ((), "blocks.1.experts.w1_EFD", "sharded on another dim: no dim-0 rows to split (FSDP2 passes no shape)"),
    ((2048,), "blocks.1.experts.bias", "one dim"),
    ((2, 32, 32), "blocks.1.experts.w1_EFD", "2048 elements, under min_numel 4096"),
    ((3, 64, 32), "blocks.1.experts.w1_EFD", "3 experts do not split over 2 ranks"),
    ((4, 64, 32), "tok_embeddings.w", "excluded by the default globs"),
])
def test_what_cannot_go_as_an_item_goes_raw(state: GiftState, shape: tuple[int, ...], name: str, why: str) -> None:
    assert euclidean_plan(state, name, shape, world=2) is None, why
