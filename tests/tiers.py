"""The suite's two tiers: which test runs in `make test` (fast) and which only in `make test-full`.

`make test` is the README's test command and CI's (`.ci/run`); it must finish in 20 minutes on a
2-core box, so it runs each feature once, on the fewest ranks and launches that can fail when the
feature breaks: in-process multi-rank tests (2 gloo ranks; 4 where a layout needs them) and seven
2-rank torchtitan launches. `make test-full` adds what repeats a fast check at scale: the 4- and
8-rank torchtitan layout matrix, kill-and-resume per layout, the GIFT-off baselines of each
trainer, the 8-rank two-level exchange matrix, the Triton kernels' ahead-of-time compile for
Hopper and a 50-step training run.

The tiers are chosen here and nowhere else: `tests/conftest.py` marks what `FULL_FILES` and
`FULL_TESTS` name with the `full` marker (`make test` runs `-m "not full"`), and
`tests/test_tiers.py` fails when a test file is in neither `FAST_FILES` nor `FULL_FILES`, when a
name here matches no test, and when a row of `FEATURES` has no fast test. A tier deselects; it
never skips (`tests/test_ci_requirements.py` fails on a skip).
"""

from __future__ import annotations

# Every test of these files runs in `make test`, except those `FULL_TESTS` names.
FAST_FILES: frozenset[str] = frozenset({
    "test_adapters.py", "test_api.py", "test_architecture.py", "test_bench_convergence.py",
    "test_bench_delayed_scale.py", "test_bench_exit_stress.py", "test_bench_frontier.py", "test_bench_layouts.py",
    "test_bench_readme.py", "test_bench_smoke.py", "test_bench_cluster.py", "test_bench_stats.py", "test_bench_sweep_adamw.py",
    "test_ci_requirements.py", "test_codec_minimum.py", "test_collectives.py", "test_config.py",
    "test_context_parallel.py", "test_corpus.py",
    "test_data_parallel.py", "test_euclidean_items.py", "test_expert_layers.py", "test_faults.py",
    "test_first_hour.py",
    "test_formats.py", "test_fused_receiver.py", "test_fused_sender.py", "test_geometries.py", "test_geometry.py",
    "test_gpu_check.py", "test_gpu_step_model.py", "test_grouped_items.py", "test_grouped_statistics.py",
    "test_hsdp.py", "test_kernels.py", "test_kernels_fp8.py", "test_layer_formats.py",
    "test_layers.py", "test_map_precision.py", "test_map_precision_arms.py", "test_overlap.py", "test_pass.py",
    "test_pass_hsdp.py", "test_recompile.py", "test_reliability.py", "test_reliability_round4.py", "test_rotation.py",
    "test_second_hop_ef.py", "test_second_moment.py", "test_selection.py", "test_statistics.py",
    "test_tensor_parallel.py", "test_tiers.py", "test_tiny_llama.py", "test_topology_model.py", "test_two_level.py",
    "test_whole_gradient.py",
    # torchtitan: the launcher's parsing, and each file's tests that launch nothing
    "test_torchtitan_launcher.py", "test_torchtitan_train.py", "test_torchtitan_hsdp.py", "test_torchtitan_pp.py",
    "test_torchtitan_cp.py", "test_torchtitan_ddp.py", "test_torchtitan_ep_graph.py",
})

# Every test of these files runs only in `make test-full`: each is a matrix of 4- or 8-rank torchrun
# launches of a layout whose GIFT code a fast in-process test covers (the `FEATURES` rows say which).
FULL_FILES: dict[str, str] = {
    "test_cluster_emulated.py": "the emulated cluster (network namespaces, root): 2 nodes x 2 ranks, 2 steps, and a "
                                "run stopped by SIGTERM (fast: test_bench_cluster.py's parsing, CI, table, cleanup)",
    "test_training.py": "a 50-step tiny-Llama run against fp32 communication (2 min; fast: the torchtitan FSDP2 and "
                        "graph_trainer runs track GIFT off with quantized gradients, test_api trains eagerly)",
    "test_torchtitan_tp.py": "TP 2 x FSDP 2, 4 ranks, 4 launches (fast: test_tensor_parallel.py)",
    "test_torchtitan_cp_layouts.py": "CP x TP / HSDP / PP, 4 ranks, 8 launches (fast: test_context_parallel.py)",
    "test_torchtitan_ep.py": "EP 2 x FSDP 4, 4 ranks, 6 launches (fast: test_expert_layers.py, test_grouped_items.py)",
    "test_torchtitan_ep_layouts.py": "EP x TP / PP / HSDP, 4 ranks, 7 launches (fast: test_expert_layers.py)",
    "test_torchtitan_layouts8.py": "HSDP x TP and PP x TP x FSDP, 8 ranks, 6 launches (fast: test_hsdp.py, "
                                   "test_tensor_parallel.py)",
}

# Tests of `FAST_FILES` that only `make test-full` runs (pytest node ids, or their prefix up to a
# parametrization), each with why it is not needed in the fast tier.
FULL_TESTS: dict[str, str] = {
    "test_kernels.py::test_every_kernel_compiles_for_hopper":
        "compiles every Triton kernel for sm_90 ahead of time (1.5 min; fast: the kernels run in the interpreter)",
    **{f"test_two_level.py::{name}": "the 8-rank two-level matrix (2 nodes x 4, 4 nodes x 2: core, DDP, FSDP2, graph "
                                     "pass; fast: test_core_on_four_ranks_as_two_nodes_of_two)"
       for name in ("test_fp32_two_level_equals_native_collective_bit_for_bit",
                    "test_nvfp4_two_level_within_format_error_and_replicas_identical",
                    "test_bytes_per_hop_counted_equal_accounting_and_cross_node_is_flat_over_g",
                    "test_map_and_encode_run_on_one_gth_of_the_elements",
                    "test_error_feedback_lives_on_the_chunk_and_nan_raises_on_every_rank",
                    "test_ddp_two_level_replicas_identical_bytes_accounted_resume_exact",
                    "test_fsdp2_two_level_shards_and_bytes", "test_graph_pass_rewrites_into_two_levels")},
    "test_reliability_round4.py::test_two_torchrun_nodes_of_unequal_size_raise_the_same_error_on_every_rank":
        "two torchrun launches of 2 + 1 processes (45 s; fast: the same layout from torchrun's variables in process, "
        "test_ranks_that_disagree_on_the_node_layout_raise_the_same_error_on_every_rank)",
    "test_two_level.py::test_compiled_bodies_equal_eager_in_two_levels":
        "4 ranks compiling the two-level bodies (fast: the eager core in test_core_on_four_ranks_as_two_nodes_of_two)",
    "test_torchtitan_train.py::test_graph_trainer_and_fsdp2_train_identically_without_gift":
        "a GIFT-off graph_trainer launch; the fast tier's graph run is held to the FSDP2 trainer's GIFT-off run",
    "test_torchtitan_train.py::test_resume_restores_gift_state[llama3_debug_gift_graph]":
        "graph_trainer's kill-and-resume (the FSDP2 trainer's runs in the fast tier; the checkpoint code is shared)",
    "test_torchtitan_train.py::test_kill_and_resume_under_hsdp_pp_and_tp":
        "4-rank kill-and-resume per layout (also `python -m bench.cluster.layouts --kill-resume`)",
    "test_torchtitan_hsdp.py::test_fsdp2_hsdp_runs_both_hops_at_their_formats_and_tracks_fp32":
        "4-rank HSDP launch (fast: test_hsdp.py runs both hops in process)",
    "test_torchtitan_hsdp.py::test_fsdp2_hsdp_at_fp32_on_both_hops_is_native_hsdp": "4-rank HSDP launch",
    "test_torchtitan_hsdp.py::test_graph_hsdp_rewrites_both_hops_at_their_formats_and_tracks_fp32":
        "4-rank graph_trainer HSDP launch (fast: test_pass_hsdp.py rewrites both hops in process)",
    "test_torchtitan_pp.py::test_pp_fsdp2_manages_and_quantizes_every_stage_and_tracks_gift_off":
        "4-rank PP launch (fast: the stages' manage and statistics tests of the same file)",
    "test_torchtitan_pp.py::test_pp_interleaved_one_state_over_two_parts_per_rank": "4-rank PP launch",
    "test_torchtitan_pp.py::test_pp_nan_on_one_stage_raises_on_every_rank_before_any_optimizer_step":
        "4-rank PP launch (fast: the fail-together tests of test_faults.py and test_reliability.py)",
    "test_torchtitan_cp.py::test_fsdp2_cp_quantizes_at_nvfp4_and_tracks_gift_off":
        "4-rank CP launch (fast: test_context_parallel.py and the CPU ring attention test)",
    "test_torchtitan_cp.py::test_cp_on_cpu_trains_like_the_same_sequences_without_cp": "4-rank CP launch",
    "test_torchtitan_cp.py::test_fsdp2_cp_at_fp32_is_exact_and_matches_gift_off": "4-rank CP launch",
    "test_torchtitan_cp.py::test_graph_cp_rewrites_the_fsdp_reduce_scatters_and_tracks_gift_off":
        "4-rank graph_trainer CP launch",
    "test_torchtitan_ddp.py::test_graph_ddp_rewrites_every_gradient_all_reduce_and_tracks_gift_off":
        "graph_trainer DDP launches (fast: test_pass.py rewrites compiled all-reduces, test_data_parallel.py)",
    "test_torchtitan_ep_graph.py::test_ep_on_graph_quantizes_the_dense_layers_and_the_experts_at_nvfp4":
        "4-rank graph_trainer EP launch (fast: test_grouped_items.py, test_euclidean_items.py)",
    "test_torchtitan_ep_graph.py::test_ep_on_graph_keeps_each_ranks_expert_residuals_and_checkpoints_them":
        "4-rank graph_trainer EP launch",
    "test_torchtitan_ep_graph.py::test_ep_on_graph_at_fp32_is_exact_and_matches_gift_off":
        "4-rank graph_trainer EP launch",
    "test_torchtitan_ep_graph.py::test_ep_with_tp_on_graph_rewrites_the_experts_whose_group_has_gift_s_ranks":
        "4-rank graph_trainer EP x TP launch",
    "test_torchtitan_ep_graph.py::test_ep_with_hsdp_on_graph_sends_the_experts_replica_all_reduce_on_gift_s_codec":
        "4-rank graph_trainer EP x HSDP launch",
    "test_torchtitan_ep_graph.py::test_ep_with_hsdp_on_graph_at_fp32_matches_gift_off":
        "4-rank graph_trainer EP x HSDP launch",
}

# The feature table: every row (a format, geometry, framework path, layout, fault class, checkpoint
# path) and the fast tests that cover it (node ids or prefixes; `tests/test_tiers.py` checks that
# each names a test `make test` runs). docs/reliability.md renders it (`python -m bench.pages.readme`).
FEATURES: dict[str, tuple[str, ...]] = {
    # formats and codec
    "every wire format (fp32, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4, mxint4, int6, int4, int3, int2, ternary)": (
        "test_formats.py::test_gaussian_error_levels", "test_formats.py::test_padding_and_wire_bytes",
        "test_formats.py::test_representable_values_round_trip_exactly"),
    "codec kernels (Triton, in the CPU interpreter)": (
        "test_kernels.py::test_the_exchange_on_the_kernel_path_sends_and_sums_the_reference_bytes",
        "test_kernels_fp8.py::test_the_exchange_on_the_kernel_path_sends_and_sums_the_reference_bytes",
        "test_fused_sender.py::test_the_exchange_sends_a_low_rank_item_through_the_fused_ops"),
    "block rotation": ("test_rotation.py::test_every_rank_decodes_the_same_rotated_bits_with_a_smaller_error",),
    "error feedback (first hop, leaky, second hop)": (
        "test_collectives.py::test_error_feedback_shrinks_the_mean_error",
        "test_second_hop_ef.py::test_replicas_bit_identical_and_residual_is_the_owners_shard"),
    "two-level exchange (inside the node, then across nodes on 1/g)": (
        "test_two_level.py::test_core_on_four_ranks_as_two_nodes_of_two", "test_two_level.py::test_layout_rules",
        "test_two_level.py::test_bf16_inside_the_node_halves_its_bytes_within_bf16_error",
        "test_two_level.py::test_mapped_grouped_experts_are_refused_under_two_levels_when_built",
        "test_two_level.py::test_the_apply_report_names_each_paths_exchange",
        "test_two_level.py::test_checkpoints_record_the_node_layout_and_refuse_its_residuals_elsewhere",
        "test_two_level.py::test_the_committed_hop_byte_table_is_what_its_measurement_renders",
        "test_two_level.py::test_two_level_bucket_at_bf16_traces_fullgraph_once"),
    "per-layer formats": ("test_layer_formats.py::test_each_layer_is_sent_and_counted_at_its_own_format",),
    # geometries and selection
    "every geometry (none, hadamard, dense, lowrank, gradient, momentum, second_moment)": (
        "test_geometries.py::test_each_geometry_round_trips_and_is_not_the_identity_unless_named_so",),
    "geometry auto by optimizer; measured selection": (
        "test_selection.py::test_apply_resolves_geometry_auto_from_the_optimizer_and_falls_back_logged_without_one",
        "test_api.py::test_auto_selection_follows_the_measurement"),
    "K-FAC statistics and sketches": ("test_statistics.py::test_sketch_whitening_reproduces_the_exact_lowrank_whitening",),
    # framework paths
    "plain module, eager": ("test_api.py::test_eager_training_identical_ranks_and_refresh_records",),
    "torch.compile graph pass (reduce-scatter buckets, all-reduce)": (
        "test_pass.py::test_bucketed_reduce_scatter_becomes_one_gift_all_to_all",
        "test_pass.py::test_ranks_end_identical_and_refresh_ran"),
    "FSDP2 (fully_shard)": ("test_data_parallel.py::test_fsdp2_apply_quantizes_managed_weights_and_counts_bytes",),
    "DDP": ("test_data_parallel.py::test_ddp_apply_quantizes_each_bucket_once_per_accumulated_step",),
    "no recompiles from step to step": (
        "test_recompile.py::test_plain_module_compiled_whole_with_changing_selections_compiles_once",),
    "torchtitan FSDP2 trainer (2 ranks)": (
        "test_torchtitan_train.py::test_gift_fsdp2_tracks_gift_off_and_matches_graph_path",
        "test_torchtitan_train.py::test_auto_by_optimizer_builds_second_moment_from_adamw_state"),
    "torchtitan graph_trainer with the GPU pass list (2 ranks)": (
        "test_torchtitan_train.py::test_gift_graph_trainer_tracks_gift_off",),
    "torchtitan TOML and --gift.* flags": ("test_torchtitan_launcher.py::test_gift_section_covers_gift_config",),
    # layouts
    "FSDP (dp_shard)": ("test_torchtitan_train.py::test_gift_fsdp2_tracks_gift_off_and_matches_graph_path",),
    "DDP (dp_replicate)": ("test_data_parallel.py::test_ddp_apply_quantizes_each_bucket_once_per_accumulated_step",
                           "test_torchtitan_ddp.py::test_graph_ddp_refuses_a_replica_format_of_its_own"),
    "HSDP (two hops)": ("test_hsdp.py::test_hsdp_each_hop_at_its_format_counts_bytes_and_keeps_replicas_identical",
                        "test_pass_hsdp.py::test_each_hop_at_its_own_format"),
    "TP": ("test_tensor_parallel.py::test_each_tp_rank_manages_its_own_block",),
    "PP": ("test_torchtitan_pp.py::test_manage_spans_parts_and_refuses_shared_names",
           "test_torchtitan_pp.py::test_statistics_paused_keeps_shape_inference_out_of_the_statistics"),
    "CP": ("test_context_parallel.py::test_statistics_summed_over_the_cp_group_are_the_whole_sequences",
           "test_torchtitan_cp.py::test_cpu_ring_attention_equals_whole_sequence_attention"),
    "EP (routed experts)": (
        "test_expert_layers.py::test_the_main_state_steps_refreshes_and_checkpoints_the_experts_state",
        "test_grouped_items.py::test_fp8_exchange_matches_each_block_exchanged_alone"),
    "layouts GIFT refuses, by name": (
        "test_torchtitan_hsdp.py::test_layouts_gift_does_not_run_are_refused_by_name",
        "test_torchtitan_pp.py::test_pipeline_refusals_name_the_reason",
        "test_torchtitan_ep_graph.py::test_experts_the_pass_cannot_carry_are_refused_by_name_unless_configured"),
    # faults
    "NaN/Inf on one rank fails every rank": (
        "test_faults.py::test_nonfinite_gradient_on_one_rank_fails_every_rank_in_the_same_step",
        "test_reliability.py::test_nan_in_an_unmanaged_gradient_on_one_rank_raises_on_every_rank"),
    "plan mismatch between ranks": ("test_collectives.py::test_mismatched_plans_raise_on_every_rank_naming_both",
                                    "test_reliability.py::test_a_plan_that_changes_after_the_first_call_raises_instead_of_hanging"),
    "ranks set up differently": ("test_faults.py::test_ranks_with_different_gift_setups_refuse_to_start",),
    "replica drift (a managed weight read directly)": (
        "test_reliability.py::test_managed_weight_read_directly_raises_on_every_rank_and_exclude_syncs_it",),
    "bad inputs and configs": ("test_formats.py::test_bad_arguments_raise_value_errors_naming_them",
                               "test_config.py::test_invalid_values_name_the_field",
                               "test_torchtitan_launcher.py::test_unknown_keys_are_errors_naming_the_key"),
    # checkpoints
    "GIFT state checkpoint round trip and validation": ("test_faults.py::test_checkpoint_round_trip_is_exact",
                                                         "test_faults.py::test_checkpoint_faults_name_layer_and_key"),
    "checkpoint conversions (format, residual format, error feedback)": (
        "test_faults.py::test_checkpoint_conversions_are_logged",
        "test_second_hop_ef.py::test_checkpoint_round_trips_and_refuses_dropping_the_second_hop_residual"),
    "experts' state in the checkpoint": ("test_expert_layers.py::test_checkpoint_round_trip_writes_into_the_stacked_tensors",),
    "torchtitan DCP kill-and-resume, bit-identical": (
        "test_torchtitan_train.py::test_resume_restores_gift_state[llama3_debug_gift_fsdp2]",),
}
