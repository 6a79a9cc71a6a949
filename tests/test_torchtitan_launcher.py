"""gift-train: TOML -> torchtitan CLI mapping, precedence and errors (no training)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("torchtitan", "torchtitan extra not installed")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.torchtitan_ext.cpu import cpu_compat  # noqa: E402

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
    assert plan.args[:4] == ["--module", "gift_compile.torchtitan_ext.cpu", "--config", "llama3_debug_gift_graph"]
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
module = "gift_compile.torchtitan_ext.cpu"
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
    assert type(config).__name__ == "GiftTrainerConfig" and config.gift.enable is True  # --config beats [job]
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
    toml = _write(tmp_path, body + '[job]\nmodule = "gift_compile.torchtitan_ext.cpu"\nconfig = "llama3_debug_gift_fsdp2"\n')
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_plan(toml, [], None)


def test_job_section_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown key 'job.nprocs'"):
        build_plan(_write(tmp_path, '[job]\nmodule = "gift_compile.torchtitan_ext.cpu"\nconfig = "x"\nnprocs = 2\n'), [], None)
    with pytest.raises(ValueError, match=r"\[job\] must name 'module' and 'config'"):
        build_plan(_write(tmp_path, "[training]\nsteps = 3\n"), [], None)


def test_invalid_gift_value_fails_at_parse_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = _write(tmp_path, '[job]\nmodule = "gift_compile.torchtitan_ext.cpu"\nconfig = "llama3_debug_gift_fsdp2"\n[gift]\nformat = "fp9"\n')
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
    # reduce_op is fixed to "sum": torchtitan normalises the loss by the global token count;
    # its gradient paths are reduce-scatters, which have no second hop to compensate.
    # progress_every is fixed to 0: torchtitan's metrics print their own progress lines
    assert config - section == {"reduce_op", "second_hop_error_feedback", "progress_every"}
    assert section - config == {"enable", "fuse"}
    assert GiftSection().to_gift_config().reduce_op == "sum"
    assert GiftSection().to_gift_config().progress_every == 0


_JOB = '[job]\nmodule = "gift_compile.torchtitan_ext.cpu"\nconfig = "llama3_debug_gift_fsdp2"\n'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[gift]\nerror_feedback = 1\n", "key 'gift.error_feedback' = 1 (int) has the wrong type; expected bool"),
        ('[gift]\nerror_feedback = "false"\n', "key 'gift.error_feedback' = 'false' (str) has the wrong type; expected bool"),
        ("[gift]\nrank = true\n", "key 'gift.rank' = True (bool) has the wrong type; expected int"),
        ('[gift]\nrank = "8"\n', "key 'gift.rank' = '8' (str) has the wrong type; expected int"),
        ('[gift]\nema = "0.9"\n', "key 'gift.ema' = '0.9' (str) has the wrong type; expected float"),
        ("[gift]\nema = nan\n", "key 'gift.ema' = nan is not a number; expected float"),
        ('[gift]\nexclude = "x.*"\n', "key 'gift.exclude' = 'x.*' (str) has the wrong type; expected a list of str"),
        ("[gift]\nexclude = [1]\n", "key 'gift.exclude' = [1] (list) has the wrong type; expected a list of str"),
        ('[gift]\nexclude = ["a,b"]\n', "key 'gift.exclude' = ['a,b']: list elements cannot contain ','"),
        ("[training]\nsteps = 2.5\n", "key 'training.steps' = 2.5 (float) has the wrong type; expected int"),
        ('[training]\ndtype = "float16"\n', "key 'training.dtype' = 'float16' (str) is not allowed; expected one of 'bfloat16', 'float32'"),
        ("[training]\nmax_norm = true\n", "key 'training.max_norm' = True (bool) has the wrong type; expected float or int"),
        ("dump_folder = 3\n", "key 'dump_folder' = 3 (int) has the wrong type; expected str"),
        # Ranges, checked on the merged values before --dry-run can succeed.
        ("[training]\nsteps = -5\n", "key 'training.steps' = -5 is invalid; allowed: an integer >= 1"),
        ("[training]\nlocal_batch_size = 0\n", "key 'training.local_batch_size' = 0 is invalid; allowed: an integer >= 1"),
        ("[training]\nseq_len = 0\n", "key 'training.seq_len' = 0 is invalid; allowed: an integer >= 1"),
        ("[gift]\nema = 1\n", "key 'gift.ema' = 1: GiftConfig.ema=1 is invalid; allowed: a finite float in [0, 1)"),
        ("[gift]\nauto_min_gain = 0.5\n", "key 'gift.auto_min_gain' = 0.5: GiftConfig.auto_min_gain=0.5 is invalid"),
        ("[gift]\nauto_max_overhead = inf\n", "key 'gift.auto_max_overhead' = inf: GiftConfig.auto_max_overhead=inf is invalid"),
        ('[gift]\nselect = ","\n', "key 'gift.select' = ',': GiftConfig.select=',' is invalid"),
        ("[gift]\nseed = 9223372036854775808\n", "key 'gift.seed' = 9223372036854775808: GiftConfig.seed="),
    ],
)
def test_bad_toml_values_name_the_key_file_value_and_type(tmp_path: Path, body: str, message: str) -> None:
    toml = _write(tmp_path, body + _JOB)
    with pytest.raises(ValueError) as info:
        build_plan(toml, [], None)
    assert str(info.value).startswith(f"{toml}: {message}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--gift.rank", "true"], "command line: key 'gift.rank' = 'true' (--gift.rank) is not a valid value; expected int"),
        (["--gift.ema=abc"], "command line: key 'gift.ema' = 'abc' (--gift.ema) is not a valid value; expected float"),
        (["--gift.ema", "nan"], "command line: key 'gift.ema' = 'nan' (--gift.ema) is not a valid value; expected float"),
        (["--training.dtype", "fp16"], "command line: key 'training.dtype' = 'fp16' (--training.dtype) is not a valid value; expected one of"),
        (["--gift.error-feedback", "false"], "command line: key 'gift.error_feedback' (--gift.error-feedback 'false') is a bool flag"),
        (["--gift.enable=true"], "command line: key 'gift.enable' (--gift.enable 'true') is a bool flag"),
        (["--gift.no-rank"], "command line: --gift.no-rank: key 'gift.rank' is not a bool flag"),
        (["--gift.rank"], "command line: key 'gift.rank' (--gift.rank) expects a value: int"),
        (["--training.steps", "-5"], "command line: key 'training.steps' = -5 is invalid; allowed: an integer >= 1"),
        (["--gift.rank=0"], "command line: key 'gift.rank' = 0: GiftConfig.rank=0 is invalid"),
        (["--gift.select", "a.*,,b.*"], "command line: key 'gift.select' = 'a.*,,b.*': GiftConfig.select='a.*,,b.*' is invalid"),
    ],
)
def test_bad_command_line_values_name_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build_plan(_write(tmp_path, _JOB), overrides, None)


def test_merged_values_are_checked_cli_first(tmp_path: Path) -> None:
    # A bad TOML value that the command line overrides is not an error (CLI > TOML) ...
    toml = _write(tmp_path, _JOB + "[training]\nsteps = -5\n[gift]\nrank = 0\n")
    plan = build_plan(toml, ["--training.steps", "3", "--gift.rank=4", "--gift.exclude", ""], None)
    config = _parse(plan.args)
    assert config.training.steps == 3 and config.gift.rank == 4
    # ... and `--gift.exclude ""` (tyro's [""]) means "exclude nothing".
    assert config.gift.to_gift_config().exclude == ()
    # The error names where the offending value came from: here the command line.
    with pytest.raises(ValueError, match=r"^command line: key 'gift.ema' = 1\.5: GiftConfig\.ema=1\.5"):
        build_plan(toml, ["--training.steps", "3", "--gift.rank=4", "--gift.ema", "1.5"], None)


def test_dry_run_refuses_negative_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = _write(tmp_path, "[training]\nsteps = -5\n" + _JOB)
    with pytest.raises(SystemExit) as info:
        main(["--toml", toml, "--dry-run"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert f"{toml}: key 'training.steps' = -5 is invalid; allowed: an integer >= 1" in captured.err
    assert "gift_compile.torchtitan_ext.train" not in captured.out  # no command printed
    with pytest.raises(SystemExit):
        main(["--toml", str(GIFT_TOML), "--gift.rank", "true", "--dry-run"])
    assert "command line: key 'gift.rank' = 'true'" in capsys.readouterr().err


def test_gift_section_rejects_non_bool_switches() -> None:
    with pytest.raises(ValueError, match=r"GiftSection\.enable=1 is invalid"):
        GiftSection(enable=1)
    with pytest.raises(ValueError, match=r"GiftSection\.fuse='no' is invalid"):
        GiftSection(fuse="no")


def test_range_errors_name_the_config_function_for_its_own_values() -> None:
    from gift_compile.torchtitan_ext.keys import check_ranges

    @dataclasses.dataclass
    class Training:
        steps: int = 0
        local_batch_size: int = 1
        seq_len: int = 1

    @dataclasses.dataclass
    class Root:
        training: Training = dataclasses.field(default_factory=Training)

    with pytest.raises(ValueError, match=r"^config function m\.f: key 'training\.steps' = 0 is invalid"):
        check_ranges(Root(), {}, "config function m.f")
    check_ranges(Root(), {"training.steps": (2, "job.toml")}, "config function m.f")  # the override wins


def test_help_lists_every_gift_flag_with_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """`gift-train --help` used to show only --toml/--nproc/--dry-run; the [gift] flags needed a
    command no page named. Now every field of the section is listed, the format help names
    every format and the block size names the block-scaled formats' choices."""
    from gift_compile.codec.spec import BLOCK_SIZE_FORMATS, FORMATS

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(GiftSection):
        assert f"--gift.{f.name.replace('_', '-')} " in out, f.name
    fmt = out[out.index("--gift.format "):out.index("--gift.scaling ")]
    assert all(name in fmt for name in FORMATS), fmt
    size = " ".join(out[out.index("--gift.block-size "):out.index("--gift.geometry ")].split())
    assert all(name in size for name in BLOCK_SIZE_FORMATS) and "16 or 32" in size, size
    metric = " ".join(out[out.index("--gift.select-metric "):out.index("--gift.auto-min-gain ")].split())
    assert "AdamW resolves to whitened" in metric, metric
    assert "--help-all" in out and "--toml" in out


def test_recipes_expand_in_toml_and_on_the_command_line(tmp_path: Path) -> None:
    from gift_compile.recipes import RECIPES, recipe, recipe_fields

    def gift_of(plan) -> Any:
        return _parse(plan.args).gift

    base = GIFT_TOML.read_text()
    assert 'recipe = "adamw-int3"' in base  # the shipped TOMLs start where GIFT's map is used
    shipped = gift_of(build_plan(str(GIFT_TOML), [], None))
    assert (shipped.format, shipped.block_size) == ("int3", 32)
    # a key next to the recipe wins; a recipe on the command line beats the TOML's keys; a flag beats both
    path = _write(tmp_path, base.replace('recipe = "adamw-int3"', 'recipe = "adamw-int3"\nblock_size = 16'))
    assert gift_of(build_plan(path, [], None)).block_size == 16
    cli = gift_of(build_plan(path, ["--gift.recipe", "muon-int2-leaky-ef"], None))
    assert (cli.format, cli.block_size, cli.error_feedback, cli.error_feedback_decay, cli.block_rotation) == (
        "int2", 32, True, 0.9, True)
    flag = gift_of(build_plan(path, ["--gift.recipe=muon-int2-leaky-ef", "--gift.error-feedback-decay", "0.5"], None))
    assert flag.error_feedback_decay == 0.5
    with pytest.raises(ValueError, match="no recipe named 'muon-int1'.*known: muon-nvfp4"):
        build_plan(path, ["--gift.recipe", "muon-int1"], None)
    for name in RECIPES:  # Python and TOML give the same config
        section = gift_of(build_plan(str(GIFT_TOML), ["--gift.recipe", name], None)).to_gift_config()
        assert all(getattr(section, k) == getattr(recipe(name, reduce_op="sum"), k) for k in recipe_fields(name)), name


def test_a_recipe_typed_to_the_trainer_directly_sets_its_fields_and_gift_trains_lines_come_back_unchanged(
        caplog: pytest.LogCaptureFixture) -> None:
    """`python -m gift_compile.torchtitan_ext.train ... --gift.recipe NAME` (no gift-train) recorded the
    recipe's name while its fields kept the config function's values; the entry point now expands it
    as gift-train does (a flag typed beside it wins), and a gift-train command line, which carries
    every field as a flag, is left as it is."""
    from gift_compile.recipes import recipe_fields
    from gift_compile.torchtitan_ext.keys import expand_argv_recipe

    base = ["--module", "gift_compile.torchtitan_ext.cpu", "--config", "llama3_debug_gift_fsdp2"]
    direct = [*base, "--gift.recipe", "muon-int2-leaky-ef", "--gift.no-block-rotation"]
    assert _parse(direct).gift.format != "int2"  # what a direct launch ran before: the recipe's name only
    with caplog.at_level("WARNING", logger="gift_compile"):
        expanded = expand_argv_recipe(direct)
    gift = _parse(expanded).gift
    assert (gift.recipe, gift.format, gift.block_size, gift.error_feedback, gift.error_feedback_decay) == (
        "muon-int2-leaky-ef", "int2", 32, True, 0.9)
    assert gift.block_rotation is False  # the typed flag beats the recipe
    assert "sets format='int2'" in caplog.text and "block_rotation" not in caplog.text
    plan = build_plan(str(GIFT_TOML), ["--gift.recipe", "muon-int2-leaky-ef"], None)
    assert expand_argv_recipe(plan.args) == list(plan.args)
    assert expand_argv_recipe(base) == base
    with pytest.raises(ValueError, match="no recipe named 'muon-int1'"):
        expand_argv_recipe([*base, "--gift.recipe=muon-int1"])
    assert set(recipe_fields("muon-int2-leaky-ef")) >= {"format", "block_size", "error_feedback"}


def test_a_recipe_conflict_on_the_command_line_or_in_the_toml_names_the_recipe_and_overrides_are_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 56, class 9, in gift-train: `recipe = "muon-int2-leaky-ef"` with `--gift.no-error-feedback`
    failed on the TOML's `gift.error_feedback_decay = 0.9`, a key the user never wrote, without
    naming the recipe, and a flag or TOML key replacing a recipe's field was not logged. Now the
    launcher holds the recipe against what was typed as `gift_compile.recipes.recipe` does."""
    from gift_compile.recipes import RecipeConflict

    base = GIFT_TOML.read_text().replace('recipe = "adamw-int3"', 'recipe = "muon-int2-leaky-ef"')
    path = str(tmp_path / "recipe.toml")
    Path(path).write_text(base)
    with pytest.raises(RecipeConflict) as err:
        build_plan(path, ["--gift.no-error-feedback", "--gift.seed", "3"], None)
    message = str(err.value)
    assert "recipe 'muon-int2-leaky-ef' does not combine with error_feedback=False (--gift.no-error-feedback on the " \
           "command line)" in message, message
    assert "Override error_feedback_decay as well" in message and "seed" not in message, message
    assert err.value.field == "error_feedback"
    # the same conflict typed next to the recipe in the TOML (a key there wins over the TOML's recipe)
    toml = str(tmp_path / "key.toml")
    Path(toml).write_text(base.replace('recipe = "muon-int2-leaky-ef"',
                                       'recipe = "muon-int2-leaky-ef"\nerror_feedback = false'))
    with pytest.raises(RecipeConflict, match=r"recipe 'muon-int2-leaky-ef' does not combine with error_feedback=False "
                                             rf"\(in {re.escape(toml)}\)"):
        build_plan(toml, [], None)
    # a value the recipe refuses on its own: its key, where it was set, and the recipe
    with pytest.raises(ValueError, match=r"command line: key 'gift.block_size' = 64: .*given to recipe "
                                         r"'muon-int2-leaky-ef'"):
        build_plan(path, ["--gift.block-size", "64"], None)
    # explicit values replacing the recipe's are logged with both values and where they were typed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gift_compile"):
        plan = build_plan(path, ["--gift.format", "int3", "--gift.seed", "3"], None)
    assert _parse(plan.args).gift.format == "int3"
    logged = [r.getMessage() for r in caplog.records if "set explicitly" in r.getMessage()]
    assert len(logged) == 1 and "format='int3' (recipe: 'int2'; --gift.format on the command line)" in logged[0], logged
    assert "seed" not in logged[0]  # a field the recipe does not set replaces nothing
    # a command-line recipe replacing the TOML's keys says which
    caplog.clear()
    with_key = str(tmp_path / "block.toml")
    Path(with_key).write_text(GIFT_TOML.read_text().replace('recipe = "adamw-int3"', "block_size = 16"))
    with caplog.at_level(logging.WARNING, logger="gift_compile"):
        assert _parse(build_plan(with_key, ["--gift.recipe", "muon-int2-leaky-ef"], None).args).gift.block_size == 32
    assert any("--gift.recipe 'muon-int2-leaky-ef' replaces block_size=16 (recipe: 32)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_start_here_config_function_builds_a_gift_trainer_config() -> None:
    """docs/torchtitan/start.md's "your own config function" (torchtitan's Llama-3-8B with a [gift]
    section), executed as written: GIFT's hook is bound and the recipe's fields are set."""
    from gift_compile.torchtitan_ext.job_config import GiftTrainerConfig

    text = (REPO / "docs" / "torchtitan" / "start.md").read_text()
    code = re.search(r"```python\n(# my_configs\.py\n.*?)```", text, flags=re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/torchtitan/start.md:my_configs.py", "exec"), scope)
    config = scope["llama3_8b_gift"]()
    assert isinstance(config, GiftTrainerConfig) and config.training.seq_len == 8192
    assert config.gift.enable and (config.gift.format, config.gift.block_size) == ("int3", 32)
    assert config.model_spec.post_optimizer_build_fn.keywords["section"] is config.gift


def test_compression_is_the_whole_gradients_on_both_trainers() -> None:
    """One definition of `gift/total_compression`: fp32 bytes of every gradient collective of
    the step over what they all handed over. graph_trainer's untouched buckets (embedding, head)
    enter both sides, scaled by the graph's runs per step; FSDP2 leaves nothing untouched.
    `gift/network_compression` counts what crossed nodes only, and is absent on one node."""
    from gift_compile.torchtitan_ext.telemetry import whole_gradient

    step = {"gift/wire_bytes_per_step": 484_000.0, "gift/baseline_bytes_per_step": 3_412_000.0,
            "gift/collectives_per_step": 8.0, "gift/cross_wire_bytes_per_step": 0.0,
            "gift/cross_baseline_bytes_per_step": 0.0}
    # graph_trainer: 4 GIFT collectives per run of the step's graph, 2 runs (2 micro-batches) per step
    graph = whole_gradient(step, (4_194_304, 4))
    assert graph["gift/untouched_bytes_per_step"] == 2 * 4_194_304
    assert graph["gift/total_compression"] == pytest.approx((3_412_000 + 2 * 4_194_304) / (484_000 + 2 * 4_194_304))
    assert graph["gift/total_compression"] < 1.4  # not the 7.05x of the rewritten buckets alone
    fsdp2 = whole_gradient(step, None)
    assert fsdp2 == {"gift/untouched_bytes_per_step": 0.0, "gift/total_compression": 3_412_000 / 484_000}
    # two levels: 400,000 of the 484,000 bytes stayed inside the node; across nodes GIFT sent
    # 84,000 where fp32 over the same layout sends the node-reduced half, 1,706,000
    two = {**step, "gift/cross_wire_bytes_per_step": 84_000.0, "gift/cross_baseline_bytes_per_step": 1_706_000.0}
    assert whole_gradient(two, None)["gift/network_compression"] == pytest.approx(1_706_000 / 84_000)
    # graph_trainer's untouched collectives cross nodes at full size where the group spans them
    spanning = whole_gradient(two, (4_194_304, 4), spans_nodes=True)
    assert spanning["gift/network_compression"] == pytest.approx((1_706_000 + 2 * 4_194_304) / (84_000 + 2 * 4_194_304))


def test_a_runs_gift_warnings_are_its_troubles_not_the_apply_report() -> None:
    """Every successful `apply` logs its report at WARNING on rank 0; the layout tests that require
    a run without GIFT warnings read `RunResult.gift_warnings`, which must still see a real one."""
    from gift_compile.runtime.report import ApplyReport
    from gift_compile.torchtitan_ext.cpu.runs import RunResult

    report = ApplyReport(path="FSDP2 custom reduce-scatter", world=4, format="nvfp4", geometry="lowrank", select="all",
                         select_metric="euclidean", managed=("a.weight",), selected=("a.weight",), first_refresh=10,
                         full_precision=(), unmatched=())
    header = f"[titan] 2026-12-07 01:06:49,590 - gift_compile - WARNING - {report.lines()[0]}"
    trouble = "[titan] 2026-12-07 01:06:50,000 - gift_compile - WARNING - GIFT: layers.0.w1 goes at full precision"
    assert RunResult([], 0, "\n".join([header, "ok"]), 1.0).gift_warnings() == []
    assert RunResult([], 0, "\n".join([header, trouble]), 1.0).gift_warnings() == [trouble]


def test_the_cpu_stand_in_registers_its_adjustments_with_the_integration() -> None:
    """The integration never imports `cpu_compat`: activated (above, on this CPU box), it has
    registered FSDP2's sum reduction and the attention-saving pass edit with `platform_hooks`,
    which the hooks and the `gift` pass pipeline call."""
    from gift_compile.torchtitan_ext import platform_hooks

    assert cpu_compat.is_active()
    assert platform_hooks._AFTER_FSDP2 == [cpu_compat.after_fsdp2]

    def first_pass(gm: Any) -> Any:
        return gm

    def selective_activation_remat_pass(gm: Any) -> Any:
        return gm

    edited = platform_hooks.edit_graph_passes([first_pass, selective_activation_remat_pass])
    assert edited == [first_pass, cpu_compat.save_deterministic_sdpa_pass, selective_activation_remat_pass]
    assert platform_hooks.edit_graph_passes([first_pass]) == [first_pass]  # no remat pass: unchanged
