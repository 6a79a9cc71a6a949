"""GiftConfig validation: every bad value names its field and the allowed values."""

import pytest

from gift_compile import GiftConfig


@pytest.mark.parametrize("kwargs,field", [
    ({"format": "fp6"}, "format"), ({"scaling": "col"}, "scaling"), ({"geometry": "svd"}, "geometry"),
    ({"rank": 0}, "rank"), ({"refresh_every": -1}, "refresh_every"), ({"ema": 1.0}, "ema"),
    ({"damping": 0.0}, "damping"), ({"select": "boundary_hits:0"}, "select"), ({"select": "best"}, "select"),
    ({"error_feedback": "yes"}, "error_feedback"), ({"block_size": 3}, "block_size"),
    ({"nonfinite": "ignore"}, "nonfinite"), ({"reduce_op": "max"}, "reduce_op"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"GiftConfig\.{field}=.*allowed"):
        GiftConfig(**kwargs)


def test_select_forms():
    assert GiftConfig(select="boundary_hits:13").boundary_hits_k == 13
    assert GiftConfig(select="layers.*.feed_forward.w2.weight").select == ("layers.*.feed_forward.w2.weight",)
    assert GiftConfig(select="a.*,b.*").select == ("a.*", "b.*")
    assert GiftConfig(select=["x.*"]).select == ("x.*",)


def test_dict_round_trip_and_unknown_keys():
    cfg = GiftConfig(format="nvfp4", rank=16, exclude=("*embed*",))
    assert GiftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GiftConfig field.*formt"):
        GiftConfig.from_dict({"formt": "fp8_e4m3"})
