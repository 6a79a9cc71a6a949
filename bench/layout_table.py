"""The torchtitan layouts `bench.layouts` measures, and on which trainer: the table's rows.

Apart from the runner (which imports torchtitan) so that `bench.pages_layouts` can render every
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
MOE_LAYOUTS = {"ep_fsdp", "ep_hsdp", "ep_tp", "ep_pp"}
# GIFT flags a layout needs: under EP the routed experts stay at full precision (FSDP2's own
# reduce-scatter, and under HSDP native HSDP's fp32 all-reduce; graph_trainer's traced efsdp
# collectives, which the pass leaves alone), which GIFT refuses unless told to warn (each expert
# module is then named); EP x PP needs no warning (efsdp = dp_shard / ep is one rank: the
# experts' gradients cross no rank). The TP-halved blocks of the debug MoE have 2048-3072
# elements, under the default min-numel 4096: at 1024 GIFT manages them (tests/test_torchtitan_ep_layouts.py)
LAYOUT_GIFT = {"ep_fsdp": ["--gift.unrewritten=warn"], "ep_hsdp": ["--gift.unrewritten=warn"],
               "ep_tp": ["--gift.unrewritten=warn", "--gift.min-numel=1024"]}


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
