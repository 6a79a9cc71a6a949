"""The torchtitan layouts `bench.cluster.layouts` measures, and on which trainer: the table's rows.

Apart from the runner (which imports torchtitan) so that `bench.pages.layouts` can render every
planned row, one without results as "not run", where only the results file is at hand.
"""

from __future__ import annotations

_SHARD, _REPLICATE = "--parallelism.data-parallel-shard-degree", "--parallelism.data-parallel-replicate-degree"
_TP, _PP, _CP, _EP = ("--parallelism.tensor-parallel-degree", "--parallelism.pipeline-parallel-degree",
                      "--parallelism.context-parallel-degree", "--parallelism.expert-parallel-degree")
# key: (title, ranks, torchtitan flags), in the table's order
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "fsdp": ("FSDP (dp_shard 2)", 2, [f"{_SHARD}=2"]),
    "ddp": ("DDP (dp_replicate 2)", 2, [f"{_REPLICATE}=2", f"{_SHARD}=1"]),
    "hsdp": ("HSDP (dp_replicate 2 x dp_shard 2)", 4, [f"{_REPLICATE}=2", f"{_SHARD}=2"]),
    "tp_fsdp": ("TP x FSDP (tp 2 x dp_shard 2)", 4, [f"{_TP}=2", f"{_SHARD}=2"]),
    "pp_fsdp": ("PP x FSDP (pp 2 x dp_shard 2)", 4, [f"{_PP}=2", f"{_SHARD}=2"]),
    "cp_fsdp": ("CP x FSDP (cp 2 x dp_shard 2)", 4, [f"{_CP}=2", f"{_SHARD}=2"]),
    # CP without dp_shard: torchtitan's fsdp mesh is dp_shard x cp, FSDP shards over the CP ranks
    "cp_tp": ("CP x TP (cp 2 x tp 2)", 4, [f"{_CP}=2", f"{_SHARD}=1", f"{_TP}=2"]),
    "hsdp_cp": ("HSDP x CP (dp_replicate 2 x cp 2)", 4, [f"{_REPLICATE}=2", f"{_SHARD}=1", f"{_CP}=2"]),
    "pp_cp": ("PP x CP (pp 2 x cp 2)", 4, [f"{_PP}=2", f"{_SHARD}=1", f"{_CP}=2"]),
    "hsdp_tp": ("HSDP x TP (dp_replicate 2 x dp_shard 2 x tp 2)", 8, [f"{_REPLICATE}=2", f"{_SHARD}=2", f"{_TP}=2"]),
    "pp_ddp": ("PP x DDP (pp 2 x dp_replicate 2)", 4, [f"{_PP}=2", f"{_REPLICATE}=2", f"{_SHARD}=1"]),
    "pp_hsdp": ("PP x HSDP (pp 2 x dp_replicate 2 x dp_shard 2)", 8, [f"{_PP}=2", f"{_REPLICATE}=2", f"{_SHARD}=2"]),
    "pp_tp_fsdp": ("PP x TP x FSDP (pp 2 x tp 2 x dp_shard 2)", 8, [f"{_PP}=2", f"{_SHARD}=2", f"{_TP}=2"]),
    "hsdp_cp_tp": ("HSDP x CP x TP (dp_replicate 2 x cp 2 x tp 2)", 8,
                   [f"{_REPLICATE}=2", f"{_SHARD}=1", f"{_CP}=2", f"{_TP}=2"]),
    "pp_cp_tp": ("PP x CP x TP (pp 2 x cp 2 x tp 2)", 8, [f"{_PP}=2", f"{_SHARD}=1", f"{_CP}=2", f"{_TP}=2"]),
    "pp_hsdp_cp": ("PP x HSDP x CP (pp 2 x dp_replicate 2 x cp 2)", 8,
                   [f"{_PP}=2", f"{_REPLICATE}=2", f"{_SHARD}=1", f"{_CP}=2"]),
    "ep_fsdp": ("EP x FSDP (ep 2 within dp_shard 4), MoE", 4, [f"{_SHARD}=4", f"{_EP}=2"]),
    "ep_hsdp": ("EP x HSDP (ep 2, dp_replicate 2 x dp_shard 2), MoE", 4,
                [f"{_REPLICATE}=2", f"{_SHARD}=2", f"{_EP}=2"]),
    "ep_tp": ("EP x TP (ep 2, dp_shard 2 x tp 2), MoE", 4, [f"{_SHARD}=2", f"{_TP}=2", f"{_EP}=2"]),
    "ep_pp": ("EP x PP (ep 2, pp 2 x dp_shard 2), MoE", 4, [f"{_PP}=2", f"{_SHARD}=2", f"{_EP}=2"]),
    # efsdp = dp_shard / ep = 2 ranks: the experts reduce-scatter over efsdp, then the replica hop
    "ep_hsdp8": ("EP x HSDP (ep 2, dp_replicate 2 x dp_shard 4), MoE", 8,
                 [f"{_REPLICATE}=2", f"{_SHARD}=4", f"{_EP}=2"]),
    # efsdp x ep = 8 ranks for the debug MoE's 4 experts: torchtitan shards the experts on dim 1
    "ep_fsdp8": ("EP x FSDP (ep 2 within dp_shard 8: more efsdp x ep ranks than experts), MoE", 8,
                 [f"{_SHARD}=8", f"{_EP}=2"]),
}
# torchtitan's graph_trainer (GraphPP) itself refuses the default 1F1B schedule ("requires a
# runtime PP schedule such as Interleaved1F1B"); with Interleaved1F1B the run reaches GIFT's setup
EXTRA = {(layout, "graph"): ["--parallelism.pipeline-parallel-schedule=Interleaved1F1B"] for layout in LAYOUTS
         if "pp" in layout.split("_")}
CONFIGS = {"fsdp2": ("llama3_debug_gift_fsdp2", "llama3_debug_nogift_fsdp2"),
           "graph": ("llama3_debug_gift_graph", "llama3_debug_nogift_graph")}
# Layouts of the MoE (`gift_moe_debug`, DeepSeek-V3 blocks), on both trainers
MOE_CONFIGS = {"fsdp2": ("moe_debug_gift_fsdp2", "moe_debug_nogift_fsdp2"),
               "graph": ("moe_debug_gift_graph", "moe_debug_nogift_graph")}
MOE_LAYOUTS = {"ep_fsdp", "ep_hsdp", "ep_tp", "ep_pp", "ep_hsdp8", "ep_fsdp8"}
# GIFT flags a layout and trainer need: under EP the FSDP2 trainer makes each local expert a GIFT
# layer where efsdp has several ranks (`fsdp2._whitened_experts`), else sends the routed experts
# on GIFT's codec with no map (`fsdp2.EuclideanReduceScatter`, `hsdp.install`), graph_trainer
# with no map (`simple_fsdp.mark_outside` and `set_replica_hop`); neither needs a flag; EP x PP needs
# none either (efsdp = dp_shard / ep is one rank: the experts' gradients cross no rank). The
# TP-halved blocks of the debug MoE have 2048-3072 elements, under the default min-numel 4096: at
# 1024 GIFT manages them (tests/test_torchtitan_ep_layouts.py)
LAYOUT_GIFT = {("ep_tp", "graph"): ["--gift.min-numel=1024"], ("ep_tp", "fsdp2"): ["--gift.min-numel=1024"]}


def configs(layout: str, trainer: str) -> tuple[str, str] | None:
    """(GIFT config, GIFT-off config) of a layout on a trainer; None where none is registered."""
    return (MOE_CONFIGS if layout in MOE_LAYOUTS else CONFIGS).get(trainer)


def planned() -> list[str]:
    """Every row the table holds, as layout/trainer in its order: each layout on each trainer
    that has a config for it."""
    return [f"{layout}/{trainer}" for layout in LAYOUTS for trainer in CONFIGS if configs(layout, trainer)]


def order(key: str) -> tuple[int, int]:
    """A row's place in the table: `LAYOUTS`' order, then the trainers'."""
    layout, trainer = key.split("/")
    return list(LAYOUTS).index(layout), list(CONFIGS).index(trainer)


_TESTS = "tests/test_torchtitan_{}.py"
_TRAIN, _CPT, _CPL, _EPT, _EPG, _EPL, _HSDPT, _PPT, _TPT, _L8, _DDPT = (
    _TESTS.format(name) for name in ("train", "cp", "cp_layouts", "ep", "ep_graph", "ep_layouts", "hsdp", "pp", "tp",
                                     "layouts8", "ddp"))
_KR = f"{_TRAIN}::test_kill_and_resume_under_hsdp_pp_and_tp"
# The suite's tests of each row (a torchtitan run of that layout on that trainer, or for a
# refused row the refusal), as pytest node ids; a row without one is measured by this bench
# only (tests/test_bench_layouts.py checks that every id names a test that exists).
SUITE: dict[str, tuple[str, ...]] = {
    "fsdp/fsdp2": (f"{_TRAIN}::test_gift_fsdp2_tracks_gift_off_and_matches_graph_path",
                   f"{_TRAIN}::test_resume_restores_gift_state[llama3_debug_gift_fsdp2]"),
    "fsdp/graph": (f"{_TRAIN}::test_gift_graph_trainer_tracks_gift_off",
                   f"{_TRAIN}::test_resume_restores_gift_state[llama3_debug_gift_graph]"),
    "ddp/graph": (f"{_DDPT}::test_graph_ddp_rewrites_every_gradient_all_reduce_and_tracks_gift_off",),
    "hsdp/fsdp2": (f"{_HSDPT}::test_fsdp2_hsdp_runs_both_hops_at_their_formats_and_tracks_fp32", f"{_KR}[hsdp]"),
    "hsdp/graph": (f"{_HSDPT}::test_graph_hsdp_rewrites_both_hops_at_their_formats_and_tracks_fp32",),
    "tp_fsdp/fsdp2": (f"{_TPT}::test_fsdp2_tp_quantizes_each_tp_block_at_nvfp4_and_tracks_gift_off", f"{_KR}[tp]"),
    "tp_fsdp/graph": (f"{_TPT}::test_graph_tp_rewrites_the_fsdp_reduce_scatters_and_leaves_tp_collectives",),
    "pp_fsdp/fsdp2": (f"{_PPT}::test_pp_fsdp2_manages_and_quantizes_every_stage_and_tracks_gift_off", f"{_KR}[pp]"),
    "cp_fsdp/fsdp2": (f"{_CPT}::test_fsdp2_cp_quantizes_at_nvfp4_and_tracks_gift_off",),
    "cp_fsdp/graph": (f"{_CPT}::test_graph_cp_rewrites_the_fsdp_reduce_scatters_and_tracks_gift_off",),
    "cp_tp/fsdp2": (f"{_CPL}::test_fsdp2_cp_layout_quantizes_sums_cp_statistics_and_tracks_gift_off[cp_tp]",),
    "cp_tp/graph": (f"{_CPL}::test_graph_cp_layout_rewrites_the_reduce_scatters_and_tracks_gift_off[cp_tp]",),
    "hsdp_cp/fsdp2": (f"{_CPL}::test_fsdp2_cp_layout_quantizes_sums_cp_statistics_and_tracks_gift_off[hsdp_cp]",),
    "hsdp_cp/graph": (f"{_CPL}::test_graph_cp_layout_rewrites_the_reduce_scatters_and_tracks_gift_off[hsdp_cp]",),
    "pp_cp/fsdp2": (f"{_CPL}::test_fsdp2_cp_layout_quantizes_sums_cp_statistics_and_tracks_gift_off[pp_cp]",),
    "hsdp_tp/fsdp2": (f"{_L8}::test_hsdp_tp_reduces_each_tp_block_over_shards_then_replicas_at_nvfp4",),
    "pp_tp_fsdp/fsdp2": (f"{_L8}::test_pp_tp_fsdp_quantizes_each_stages_tp_blocks_at_nvfp4",),
    "ep_fsdp/fsdp2": (f"{_EPT}::test_ep_quantizes_the_dense_layers_and_the_experts_at_nvfp4",),
    "ep_fsdp/graph": (f"{_EPG}::test_ep_on_graph_quantizes_the_dense_layers_and_the_experts_at_nvfp4",),
    "ep_hsdp/fsdp2": (f"{_EPL}::test_ep_with_hsdp_runs_both_hops_on_the_dense_groups_and_the_replica_hop_on_the_"
                      "experts",),
    "ep_hsdp/graph": (f"{_EPG}::test_ep_with_hsdp_on_graph_sends_the_experts_replica_all_reduce_on_gift_s_codec",
                      f"{_EPG}::test_ep_with_hsdp_on_graph_at_fp32_matches_gift_off"),
    "ep_tp/fsdp2": (f"{_EPL}::test_ep_with_tp_quantizes_each_tp_block_and_tracks_gift_off",),
    "ep_tp/graph": (f"{_EPG}::test_ep_with_tp_on_graph_rewrites_the_experts_whose_group_has_gift_s_ranks",),
    "ep_pp/fsdp2": (f"{_EPL}::test_ep_with_pp_runs_gift_per_stage_and_experts_cross_no_rank",),
    # graph_trainer refuses every pipeline layout by one rule (its refusal's test)
    **{f"{layout}/graph": (f"{_PPT}::test_pipeline_refusals_name_the_reason",) for layout in LAYOUTS
       if "pp" in layout.split("_")},
}
