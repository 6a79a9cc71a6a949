"""GiftConfig validation: every bad value names its field and the allowed values."""

import dataclasses

import pytest

from gift_compile import GiftConfig
from gift_compile.config import GiftConfigError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs,field", [
    ({"format": "fp6"}, "format"), ({"scaling": "col"}, "scaling"), ({"geometry": "svd"}, "geometry"),
    ({"rank": 0}, "rank"), ({"refresh_every": -1}, "refresh_every"), ({"ema": 1.0}, "ema"),
    ({"damping": 0.0}, "damping"), ({"select": "boundary_hits:0"}, "select"), ({"select": "best"}, "select"),
    ({"error_feedback": "yes"}, "error_feedback"), ({"block_size": 3}, "block_size"),
    ({"nonfinite": "ignore"}, "nonfinite"), ({"reduce_op": "max"}, "reduce_op"),
    ({"unrewritten": "ignore"}, "unrewritten"), ({"plan_check": "never"}, "plan_check"),
    ({"reselect_every": -1}, "reselect_every"), ({"statistics": "exact"}, "statistics"),
    ({"sketch_cols": -2}, "sketch_cols"), ({"residual_format": "fp16"}, "residual_format"),
    ({"replica_format": "fp16"}, "replica_format"), ({"map_precision": "fp16"}, "map_precision"),
    ({"map_precision": "ieee"}, "map_precision"),
    ({"intra_node_format": "bfloat16"}, "intra_node_format"),
    ({"intra_node_format": "bf16", "ranks_per_node": 0}, "intra_node_format"),
    ({"shard_hop": "fp32"}, "shard_hop"), ({"shard_hop": "native", "replica_format": "int4"}, "replica_format"),
    ({"format": "fp8_e4m3", "scaling": "row", "block_rotation": True}, "block_rotation"),
    ({"format": "fp8_e4m3", "replica_format": "int4", "block_size": 64}, "block_size"),
    ({"format": "fp32", "stochastic_rounding": True}, "stochastic_rounding"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"GiftConfig\.{field}=.*allowed"):
        GiftConfig(**kwargs)


# Wrong types and non-finite numbers, one case per field (several for the numeric ones):
# each must fail at construction with a GiftConfigError naming the field, never a TypeError
# from a comparison or a silent acceptance that fails later.
BAD_TYPES = [
    ("format", 3), ("format", None), ("scaling", b"row"), ("geometry", ["lowrank"]),
    ("nonfinite", 0), ("reduce_op", 1), ("select_metric", None), ("unrewritten", False), ("plan_check", 2),
    ("reselect_every", 1.5), ("statistics", 1), ("sketch_cols", "64"), ("residual_format", None),
    ("replica_format", None), ("replica_format", 4), ("map_precision", None), ("map_precision", True),
    ("ranks_per_node", -1), ("ranks_per_node", 2.0), ("ranks_per_node", "4"), ("ranks_per_node", True),
    ("intra_node_format", "fp16"), ("intra_node_format", None), ("intra_node_format", 16),
    ("shard_hop", None), ("shard_hop", True),
    ("recipe", 3), ("recipe", None), ("progress_every", -1), ("progress_every", 2.5), ("progress_every", "10"),
    ("unmapped_format", None), ("unmapped_format", "int7"), ("tiny_format", "int2"), ("tiny_format", None),
    ("excluded_format", None), ("excluded_format", "fp64"),
    ("block_size", 32.0), ("block_size", True), ("rank", True), ("rank", "8"), ("refresh_every", False), ("refresh_warmup", -1), ("refresh_warmup", 2.0),
    ("refresh_every", 10.0), ("stats_tokens", "1024"), ("min_numel", True), ("min_numel", 4096.0),
    ("min_numel", -1), ("seed", "0"), ("seed", True), ("seed", 1.5), ("seed", 2**70), ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("ema", "0.9"), ("ema", True), ("ema", NAN), ("ema", INF), ("damping", "1e-3"), ("damping", NAN),
    ("damping", None), ("auto_min_gain", NAN), ("auto_min_gain", INF), ("auto_min_gain", True),
    ("auto_min_gain", "2"), ("auto_max_overhead", INF), ("auto_max_overhead", NAN), ("auto_max_overhead", False),
    ("auto_network_gbps", 0.0), ("auto_network_gbps", INF), ("auto_network_gbps", "100"),
    ("error_feedback", 1), ("error_feedback", "false"), ("second_hop_error_feedback", 1),
    ("second_hop_error_feedback", None), ("error_feedback_decay", "0.9"), ("error_feedback_decay", NAN),
    ("error_feedback_decay", True), ("error_feedback_decay", -0.1), ("error_feedback_decay", 0.5),
    ("stochastic_rounding", 0), ("stochastic_rounding", "true"), ("block_rotation", 1), ("layer_formats", 3),
    ("select", ","), ("select", "a.*,,b.*"), ("select", ()), ("select", []), ("select", ("a.*", "")),
    ("select", ("a.*", 3)), ("select", 5), ("select", None),
    ("exclude", 5), ("exclude", None), ("exclude", ("*embed*", 3)), ("exclude", ("",)), ("exclude", ""),
    ("exclude", "a.*,"), ("exclude", ["  "]),
]


@pytest.mark.parametrize("field,value", BAD_TYPES, ids=[f"{f}={v!r}" for f, v in BAD_TYPES])
def test_wrong_types_and_nonfinite_values_name_the_field(field, value):
    with pytest.raises(GiftConfigError, match=rf"^GiftConfig\.{field}=.* is invalid; allowed: ") as info:
        GiftConfig(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_every_field_has_a_bad_type_case():
    assert {f.name for f in dataclasses.fields(GiftConfig)} == {f for f, _ in BAD_TYPES}


def test_accepted_edge_values_are_normalised():
    cfg = GiftConfig(ema=0, damping=1e-6, auto_min_gain=1, auto_max_overhead=3, exclude="*embed*, *lm_head*")
    # Ints given to float fields are stored as floats; exclude strings split like select's.
    assert (cfg.ema, cfg.auto_min_gain, cfg.auto_max_overhead) == (0.0, 1.0, 3.0)
    assert all(type(v) is float for v in (cfg.ema, cfg.auto_min_gain, cfg.auto_max_overhead))
    assert cfg.exclude == ("*embed*", "*lm_head*")
    assert GiftConfig(exclude=()).exclude == () and GiftConfig(exclude=["a.*"]).exclude == ("a.*",)
    for seed in (-(2**63), -1, 2**63 - 1):  # the int64 range of the seed tensor
        assert GiftConfig(seed=seed).seed == seed


def test_map_precision_is_held_as_its_member_and_reaches_the_item_plans():
    """The spelling becomes the `MapPrecision` member (equal to its spelling, so TOML and JSON
    keep the string); "auto" is the default; the layers' plan carries the config's choice."""
    from gift_compile.geometry.table import geometry_class
    from gift_compile.kernels import MapPrecision
    from gift_compile.runtime.state import layer_spec

    assert GiftConfig().map_precision is MapPrecision.AUTO
    for spelling in ("exact", "tf32", "bf16", "auto"):
        cfg = GiftConfig(map_precision=spelling)
        assert cfg.map_precision is MapPrecision(spelling) and cfg.to_dict()["map_precision"] == spelling
        assert layer_spec(cfg, geometry_class("lowrank")).plan.map_precision is MapPrecision(spelling)


def test_select_forms():
    assert GiftConfig(select="boundary_hits:13").boundary_hits_k == 13
    assert GiftConfig(select="layers.*.feed_forward.w2.weight").select == ("layers.*.feed_forward.w2.weight",)
    assert GiftConfig(select="a.*,b.*").select == ("a.*", "b.*")
    assert GiftConfig(select=["x.*"]).select == ("x.*",)


def test_dict_round_trip_and_unknown_keys():
    cfg = GiftConfig(format="nvfp4", rank=16, exclude=("*embed*",))
    assert GiftConfig.from_dict(cfg.to_dict()) == cfg
    cfg = GiftConfig(select="a.*,b.*", ema=0, seed=2**63 - 1, exclude="x.*", stochastic_rounding=True)
    assert GiftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GiftConfig field.*formt"):
        GiftConfig.from_dict({"formt": "fp8_e4m3"})
    with pytest.raises(GiftConfigError, match=r"GiftConfig\.seed='0'"):
        GiftConfig.from_dict({**GiftConfig().to_dict(), "seed": "0"})


def test_refresh_schedule_warms_up_then_follows_refresh_every():
    due = [s for s in range(1, 260) if GiftConfig().refresh_due(s)]
    assert due == [10, 20, 40, 50, 100, 150, 200, 250]  # the defaults: warm-up 10, every 50
    assert [s for s in range(1, 130) if GiftConfig(refresh_warmup=0).refresh_due(s)] == [50, 100]
    assert [s for s in range(1, 70) if GiftConfig(refresh_every=20, refresh_warmup=3).refresh_due(s)] == [3, 6, 12, 20,
                                                                                                        40, 60]
    assert [s for s in range(1, 70) if GiftConfig(refresh_every=20, refresh_warmup=20).refresh_due(s)] == [20, 40, 60]


def test_block_size_error_names_the_formats_choices_first():
    """int2 with block_size=7 used to say "an even positive integer", and 8 then "16 or 32":
    the format's own choices come first."""
    for size in (7, 8):
        with pytest.raises(ValueError, match=r"block_size=%d is invalid; allowed: 16 or 32 for format='int2'" % size):
            GiftConfig(format="int2", block_size=size)
    with pytest.raises(ValueError, match="an even positive integer"):
        GiftConfig(format="fp8_e4m3", scaling="block", block_size=7)
