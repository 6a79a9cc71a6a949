"""gift-train: TOML -> torchtitan CLI mapping, precedence and errors (no training)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.torchtitan_ext import cpu_compat  # noqa: E402

cpu_compat.activate()

from torchtitan.config import ConfigManager  # noqa: E402

from gift_compile.torchtitan_ext.launcher import build_plan, main  # noqa: E402
from gift_compile.torchtitan_ext.section import GiftSection  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIFT_TOML = REPO / "configs" / "llama3_debug_gift.toml"


def _parse(args: list[str]):
    return ConfigManager().parse_args(list(args))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_keys_map_to_torchtitan_options_and_cli_wins() -> None:
    plan = build_plan(str(GIFT_TOML), ["--gift.format", "fp8_e5m2", "--training.steps=5", "--gift.no-enable"], None)
    assert plan.nproc == 2
    assert plan.args[:4] == ["--module", "gift_compile.torchtitan_ext", "--config", "llama3_debug_gift_graph"]
    # Keys given on the command line are dropped from the TOML part, not duplicated.
    assert "--gift.enable" not in plan.args and "--training.steps" not in plan.args
    assert plan.args.count("--gift.format") == 1
    config = _parse(plan.args)
    assert config.gift.format == "fp8_e5m2"  # CLI beats TOML (fp8_e4m3)
    assert config.training.steps == 5  # CLI beats TOML (20)
    assert config.gift.enable is False  # CLI flag beats TOML enable = true
    assert config.training.local_batch_size == 4  # from TOML
    assert config.gift.refresh_every == 10  # TOML beats the config function (50)
    assert config.validator.freq == 10 and config.validator.steps == 4  # TOML tables
    assert config.dump_folder == "./outputs/llama3_debug_gift"  # top-level key
    assert config.compile.pass_pipeline == "gift"  # config-function default kept


def test_nested_tables_lists_and_job_overrides(tmp_path: Path) -> None:
    toml = _write(
        tmp_path,
        """
[job]
module = "gift_compile.torchtitan_ext"
config = "llama3_debug_nogift_fsdp2"
nproc = 2

[gift]
exclude = ["*embed*", "*lm_head*"]
select = "boundary_hits:3"

[validator.dataloader]
dataset = "gift_shakespeare"
""",
    )
    plan = build_plan(toml, ["--config", "llama3_debug_gift_fsdp2"], 1)
    assert plan.nproc == 1  # --nproc beats job.nproc
    config = _parse(plan.args)
    assert type(config).__name__ == "Config" and config.gift.enable is True  # --config beats [job]
    assert config.gift.exclude == ["*embed*", "*lm_head*"]
    assert config.gift.to_gift_config().boundary_hits_k == 3
    assert config.validator.dataloader.dataset == "gift_shakespeare"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[training]\nstepz = 3\n", "unknown key 'training.stepz'"),
        ("[gift]\nformatt = 'fp8_e5m2'\n", "unknown key 'gift.formatt'"),
        ("[trainingg]\nsteps = 3\n", "unknown key 'trainingg.steps'"),
        ("dump_folderr = 'x'\n", "unknown key 'dump_folderr'"),
        ("[training.steps]\nx = 1\n", "unknown key 'training.steps.x'"),
        ("[validator]\ndataloader = 3\n", "key 'validator.dataloader' is a section"),
        ("[training]\nsteps = [[1]]\n", "unsupported TOML value"),
    ],
)
def test_unknown_keys_are_errors_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    # [job] last: top-level keys must come before the first table.
    toml = _write(tmp_path, body + '[job]\nmodule = "gift_compile.torchtitan_ext"\nconfig = "llama3_debug_gift_fsdp2"\n')
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_plan(toml, [], None)


def test_job_section_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown key 'job.nprocs'"):
        build_plan(_write(tmp_path, '[job]\nmodule = "gift_compile.torchtitan_ext"\nconfig = "x"\nnprocs = 2\n'), [], None)
    with pytest.raises(ValueError, match=r"\[job\] must name 'module' and 'config'"):
        build_plan(_write(tmp_path, "[training]\nsteps = 3\n"), [], None)


def test_invalid_gift_value_fails_at_parse_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = _write(tmp_path, '[job]\nmodule = "gift_compile.torchtitan_ext"\nconfig = "llama3_debug_gift_fsdp2"\n[gift]\nformat = "fp9"\n')
    with pytest.raises(SystemExit):
        main(["--toml", toml, "--dry-run"])
    assert "GiftConfig.format='fp9' is invalid" in capsys.readouterr().err
    with pytest.raises(ValueError, match="GiftConfig.geometry"):
        GiftSection(geometry="cholesky")


def test_unknown_key_on_command_line_exits_with_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--toml", str(GIFT_TOML), "--gift.formatt", "fp8_e5m2", "--dry-run"])
    assert "gift.formatt" in capsys.readouterr().err


def test_shipped_toml_files_parse(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted((REPO / "configs").glob("*.toml"))
    assert {f.name for f in files} >= {
        "llama3_debug_gift.toml",
        "llama3_debug_nogift.toml",
        "llama3_debug_gift_fsdp2.toml",
        "llama3_debug_nogift_fsdp2.toml",
    }
    for toml in files:
        assert main(["--toml", str(toml), "--dry-run"]) == 0
        assert "gift_compile.torchtitan_ext.train" in capsys.readouterr().out


def test_gift_section_covers_gift_config() -> None:
    section = {f.name for f in dataclasses.fields(GiftSection)}
    config = {f.name for f in dataclasses.fields(GiftConfig)}
    # reduce_op is fixed to "sum": torchtitan normalises the loss by the global token count.
    assert config - section == {"reduce_op"}
    assert section - config == {"enable", "fuse"}
    assert GiftSection().to_gift_config().reduce_op == "sum"
