"""The mutation drill's catalogue: each planted bug (a snippet, its replacement, what it breaks) and the tests
meant to catch it. ``python -m tests.mutants`` runs them; ``tests/test_mutants.py`` keeps them in sync with the code.
"""

from __future__ import annotations

from typing import NamedTuple


class Mutant(NamedTuple):
    """One planted bug: ``find`` (which must occur exactly once in ``file``) becomes ``replace``."""

    id: str
    file: str  # relative to the repository root
    find: str
    replace: str
    what: str  # one line: the bug, in words
    tests: tuple[str, ...]  # pytest node ids or files expected to catch it, fastest first


# Node ids; a parametrized case's id (the part in brackets) is pytest's and is checked only by running.
T_COLL = "tests/shardings/comm/test_collectives.py"
T_LOCAL = ("tests/shardings/step/test_local_step.py::"
           "test_local_path_matches_the_single_device_reference_with_accumulation_clipping_and_small_buckets")
T_RING = "tests/shardings/ops/test_ring_attention.py"
T_KERNELS = "tests/shardings/ops/test_attention_kernels.py"
T_MP = "tests/shardings/step/test_mixed_precision.py"
T_SCHEDULE = "tests/shardings/pipeline/test_schedule.py"
T_PIPE = "tests/shardings/pipeline/test_execute.py"
T_RULES = "tests/shardings/spec/test_rules.py"
T_DESIGN = "tests/shardings/spec/test_layouts.py::test_design_table"
T_CP_EP = "tests/shardings/spec/test_presets.py"  # written for the drill: rule changes equivalence cannot see
T_MOE = "tests/models/test_moe.py::test_moe_mlp_equals_loop_reference"
T_MOE_HAND = "tests/models/test_moe.py::"  # + a hand-computed case (an oracle calling moe.capacity cannot catch it)
T_NLL = ("tests/shardings/ops/test_vocab_parallel.py::"
         "test_per_token_nll_equals_torchs_cross_entropy_with_three_small_all_reduces")
T_CKPT = "tests/shardings/checkpoint/test_checkpoint.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- the collectives' transposes (shard_map's check_rep=False convention) --------------------------
    Mutant("psum-transpose-identity", "shardings/comm/collectives.py",
           "return _PSum.apply(g, ctx.ax), None",
           "return g, None",
           "psum's backward passes the cotangent through instead of psumming it",
           (f"{T_COLL}::test_psum_and_pmean",)),
    Mutant("all-gather-transpose-dim0", "shardings/comm/collectives.py",
           "return _PSumScatter.apply(g, ctx.ax, ctx.dim), None, None",
           "return _PSumScatter.apply(g, ctx.ax, 0), None, None",
           "all_gather's backward reduce-scatters along dim 0 whatever dim was gathered",
           (f"{T_COLL}::test_all_gather",)),
    Mutant("psum-scatter-transpose-mean", "shardings/comm/collectives.py",
           "return _AllGather.apply(g, ctx.ax, ctx.dim), None, None",
           "return _AllGather.apply(g / ctx.ax.size, ctx.ax, ctx.dim), None, None",
           "psum_scatter's backward all-gathers the cotangent divided by the axis size (a mean's transpose)",
           (f"{T_COLL}::test_psum_scatter",)),
    Mutant("all-to-all-transpose-not-reversed", "shardings/comm/collectives.py",
           "return _AllToAll.apply(g, ctx.ax, ctx.concat, ctx.split), None, None, None",
           "return _AllToAll.apply(g, ctx.ax, ctx.split, ctx.concat), None, None, None",
           "all_to_all's backward repeats the forward exchange instead of reversing split and concat",
           (f"{T_COLL}::test_all_to_all",)),
    Mutant("flattened-axis-scatter-order-not-inverted", "shardings/comm/axis_comm.py",
           "x = _reorder(x, _inverse(ax.order)).contiguous()\n    return _wait(reduce_scatter_single(",
           "x = _reorder(x, ax.order).contiguous()\n    return _wait(reduce_scatter_single(",
           "a reduce-scatter over axes named out of mesh order permutes blocks by the order, not its inverse "
           "(psum_scatter, and all_gather's transpose)",
           (f"{T_COLL}::test_psum_scatter", f"{T_COLL}::test_all_gather")),
    # -- the lowering: logical names -> P -> placements ----------------------------------------------
    Mutant("rules-fallback-reuses-axis", "shardings/spec/rules.py",
           "if name == rule_name and chosen[dim] is None and used.isdisjoint(axes):",
           "if name == rule_name and chosen[dim] is None:",
           "logical_to_spec gives a mesh axis to a dim although another dim of the tensor already uses it",
           (f"{T_RULES}::test_fallback_cases", f"{T_RULES}::test_flax_semantics")),
    Mutant("lower-split-factor-reversed", "shardings/spec/lower.py",
           "for earlier in axes[:k] if index[earlier] > index[name]]",
           "for earlier in axes[:k] if index[earlier] < index[name]]",
           "a tuple of axes out of mesh order gets the split factors of the opposite order (_StridedShard)",
           ("tests/shardings/spec/test_lower.py::test_to_placements_examples",
            "tests/shardings/spec/test_lower.py::test_to_placements_three_axes_split_factors")),
    Mutant("lower-chunk-floor", "shardings/spec/lower.py",
           "step = -(-(stop - start) // n_chunks)",
           "step = (stop - start) // n_chunks",
           "local_block cuts uneven dims with floor instead of torch.chunk's ceil (the last elements go nowhere)",
           ("tests/shardings/spec/test_lower.py::test_local_block_examples",
            "tests/shardings/spec/test_lower.py::test_local_blocks_cover_each_element_once_per_replica")),
    # -- the layout rules (presets) ------------------------------------------------------------------
    Mutant("hsdp-shards-over-dp", "shardings/spec/presets.py",
           '_HSDP = _shard_params_over("fsdp")',
           "_HSDP = _shard_params_over(DATA_AXES)",
           "hsdp shards parameters over dp too (it becomes zero3: no replica axis)",
           (T_DESIGN,)),
    Mutant("sp-outranks-tp", "shardings/spec/presets.py",
           'tier="sequence", **_IN_STAGES)',
           'tier="data", **_IN_STAGES)',
           "sp's seq -> tp rule is in a tier before tp's: attention and MLP activations put seq on tp, not heads/mlp",
           (T_DESIGN,)),
    Mutant("cp-kv-seq-replicated", "shardings/spec/presets.py",
           'register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", CP_AXIS)])),',
           'register("cp", Layout(batch=_SEQ, activations=_SEQ + Rules([("kv_seq", None)])),',
           "preset cp replicates kv_seq: attention all-gathers K/V (cp_allgather's memory) instead of the ring",
           (f"{T_CP_EP}::test_cp_rings_kv_and_cp_allgather_gathers_them",
            f"{T_RING}::test_ring_passes_kv_cp_minus_one_times_forward_and_kv_dkv_in_backward")),
    Mutant("ep-ranks-after-data", "shardings/spec/presets.py",
           'group="ep", needs=((EP_AXIS,),), tier="expert",',
           'group="ep", needs=((EP_AXIS,),), tier="pipeline",',
           "ep's rules come in a tier after the data presets' and tp's: tokens stop splitting over ep (ep ranks "
           "duplicate work) and tp's expert -> None wins",
           (f"{T_CP_EP}::test_ep_splits_tokens_over_ep_and_experts_in_every_role",
            "tests/shardings/step/test_ep_memory_and_comms.py::test_ep_layouts_persistent_bytes_per_role_and_collectives_per_step")),
    # -- bucket and microbatch averaging ----------------------------------------------------------------
    Mutant("local-token-total-not-all-reduced", "shardings/step/local_step.py",
           'counts = fc.wait(funcol.all_reduce(counts, "sum", comm.group(m)))',
           "counts = counts",
           "each rank weighs its loss by its share of its own tokens, not of the global batch's (grads x ranks)",
           (f"{T_LOCAL}[dp-mesh0]",)),
    Mutant("local-accumulation-dropped", "shardings/step/local_step.py",
           "ready[j][i] = g + acc[i] if i in acc else g",
           "ready[j][i] = g",
           "a bucket's reduction keeps only the last microbatch's gradient, dropping the accumulated ones",
           (f"{T_LOCAL}[dp-mesh0]",)),
    Mutant("dtensor-microbatch-weight-uniform", "shardings/step/dtensor_path.py",
           "weight = ctx.token_count(mb) / total_tokens",
           "weight = 1 / ctx.accum_steps",
           "the DTensor path averages microbatch means instead of weighing each by its share of the tokens",
           ("tests/shardings/step/test_layout_matrix.py::test_layout_matrix_matches_the_single_device_reference",)),
    Mutant("reduce-scatter-pack-leaf-major", "shardings/comm/flat_comm.py",
           "flat = torch.cat([c[r].reshape(-1) for r in range(n) for c in chunks])",
           "flat = torch.cat([c[r].reshape(-1) for c in chunks for r in range(n)])",
           "a bucket's flat buffer is packed leaf-major, so the reduce-scatter hands ranks the wrong chunks",
           (f"{T_LOCAL}[zero2-mesh2]",)),
    # -- ZeRO-3's backward re-gather -------------------------------------------------------------------
    Mutant("zero3-regather-wrong-leaf", "shardings/residency/gather_params.py",
           "self.gathered(saved.bucket)[saved.pos]",
           "self.gathered(saved.bucket)[-1]",
           "backward's re-gather hands autograd the bucket's last leaf for every saved weight",
           (f"{T_LOCAL}[zero3-mesh3]",)),
    Mutant("zero3-prefetch-wrong-way", "shardings/residency/gather_params.py",
           "nxt = self.buckets[self.order[at + 1]]",
           "nxt = self.buckets[self.order[at - 1]]",
           "backward prefetches the bucket it already re-gathered (at the first: the last one) instead of the next",
           ("tests/shardings/step/test_local_step.py::test_zero3_regathers_buckets_in_backward_prefetching_the_next",
            "tests/shardings/residency/test_zero3_regather.py::"
            "test_dtensor_path_zero3_regathers_buckets_in_backward_prefetching_the_next")),
    Mutant("zero3-regathered-buckets-kept", "shardings/residency/gather_params.py",
           "bucket.cached, bucket.pending, bucket.done = None, None, True",
           "bucket.pending, bucket.done = None, True",
           "backward keeps every re-gathered bucket until it ends (values unchanged, data parallelism's memory)",
           ("tests/shardings/residency/test_zero3_peak_memory.py::"
            "test_the_peak_grows_by_the_blocks_gradients_and_at_most_one_gathered_block[zero3-local]",
            "tests/shardings/residency/test_zero3_peak_memory.py::"
            "test_the_peak_grows_by_the_blocks_gradients_and_at_most_one_gathered_block[zero3+tp+sp-dtensor]")),
    # -- ring attention: the mask and the online-softmax merge ------------------------------------------
    Mutant("ring-diagonal-unmasked", "shardings/ops/ring_attention.py",
           "o, block_lse = kernels.block_forward(q[:, qi], k[:, ki], v[:, ki], masked, scale)",
           "o, block_lse = kernels.block_forward(q[:, qi], k[:, ki], v[:, ki], False, scale)",
           "the ring's diagonal block runs the kernel without its causal mask (queries see later keys)",
           (f"{T_RING}::test_equals_reference_values_and_grads",)),
    Mutant("ring-merge-no-rescale", "shardings/ops/ring_attention.py",
           "out[:, qi] = out[:, qi] * to_rows(lse[..., qi]) + o * to_rows(block_lse)",
           "out[:, qi] = out[:, qi] + o * to_rows(block_lse)",
           "the online-softmax merge does not rescale the running output by its old log-sum-exp",
           (f"{T_RING}::test_equals_reference_values_and_grads",)),
    # -- the fused attention kernels: a 1% error against the einsum reference --------------------------
    Mutant("fused-attention-one-percent", "shardings/ops/attention_kernels.py",
           "    return out.transpose(1, 2)\n",
           "    return out.transpose(1, 2) * 1.01\n",
           "the fused kernel's output is 1% too large (every layout would agree with a single device that has it)",
           (f"{T_KERNELS}::test_fused_equals_the_reference",)),
    Mutant("block-backward-stale-lse", "shardings/ops/attention_kernels.py",
           "lse.to(accumulator(q.dtype)).contiguous(), 0.0, causal",
           "(lse + 0.01).to(accumulator(q.dtype)).contiguous(), 0.0, causal",
           "the block backward uses a log-sum-exp 0.01 off the merged one (probabilities 1% low)",
           (f"{T_KERNELS}::test_blocks_merged_by_log_sum_exp_equal_the_whole", T_RING)),
    # -- pipeline parallelism: schedules, the executor, the step across stages -------------------------
    Mutant("1f1b-one-more-warmup", "shardings/pipeline/schedule.py",
           "warmup = min(pp - r - 1 + seq_chunks - 1, units)",
           "warmup = min(pp - r + seq_chunks - 1, units)",
           "1F1B warms up with one forward too many (holds pp - r + 1 microbatches)",
           (f"{T_SCHEDULE}::test_one_f_one_b_warms_up_then_alternates",)),
    Mutant("pipeline-accumulate-one-percent", "shardings/pipeline/runner.py",
           "self.grads[key] = g if held is None else held + g",
           "self.grads[key] = g if held is None else held + 1.01 * g",
           "microbatch gradients after the first are accumulated 1% too large",
           (f"{T_PIPE}::test_adamw_steps_equal_one_device_with_clipping",)),
    Mutant("pipeline-saved-output-cycle", "shardings/pipeline/saved_activations.py",
           "return _Held(self, rank, st, t.detach())",
           "return _Held(self, rank, st, t)",
           "a saved output is held with its own node: a cycle gc cannot collect, each zero-bubble step's graph leaks",
           ("tests/shardings/pipeline/test_delivery.py::test_a_zero_bubble_step_leaves_none_of_its_graphs_behind",)),
    Mutant("pipeline-send-freed-at-its-receive", "shardings/pipeline/delivery.py",
           "if clock[i][(q := schedule.rank_of(_receiver(s).stage))] > position[q][_receiver(s)])",
           "if clock[i][(q := schedule.rank_of(_receiver(s).stage))] >= position[q][_receiver(s)])",
           "a send counts as delivered when its peer has only reached the receive (not run it): its buffer is freed "
           "(waited on) too early",
           ("tests/shardings/pipeline/test_delivery.py::test_a_send_is_released_only_once_its_receive_happened_before",)),
    Mutant("zb-w-recounts-input-paths", "shardings/pipeline/backward.py",
           "for k, _ in node.next_functions if k is not None and not on_input[k]))",
           "for k, _ in node.next_functions if k is not None))",
           "W re-enters the graph also along the input path: weights below another recorded node counted twice",
           ("tests/shardings/pipeline/test_backward.py::test_b_then_w_is_the_whole_backward_bitwise",)),
    Mutant("interleaved-chunks-contiguous", "shardings/pipeline/interleaved.py",
           "computes.append(Action(kind, chunk * pp + r, mb))",
           "computes.append(Action(kind, r * v + chunk, mb))",
           "interleaved 1F1B gives rank r contiguous stages r*v.. instead of round-robin chunks r, r + pp, ...",
           ("tests/shardings/pipeline/test_interleaved.py::test_bubble_is_1f1bs_divided_by_v",)),
    Mutant("split-head-on-the-second-stage", "shardings/pipeline/stages.py",
           "edge = [rest / 2 if s in (0, stages - 1) else 0.0 for s in range(stages)]",
           "edge = [rest / 2 if s in (0, 1) else 0.0 for s in range(stages)]",
           "the block split charges the head to stage 1 instead of the last stage (results unchanged, stages "
           "unbalanced)",
           ("tests/shardings/pipeline/test_split_balance.py::test_the_most_expensive_stage_is_the_balanced_optimum",)),
    Mutant("pp-edge-grads-not-summed", "shardings/step/pipeline_path.py",
           "ownership.sum_shared(own, reduced)",
           "None",
           "on real ranks the embedding/head gradients are not summed over the stages",
           ("tests/shardings/pipeline/test_train_step_real.py::test_real_ranks_equal_one_device",)),
    Mutant("pp-zero3-not-gathered-once", "shardings/step/pipeline_path.py",
           "compute = tree.unflatten(plan.treedef, _gather_once(ctx, plan, params))",
           "compute = params",
           "ZeRO-3 in a stage hands the schedule the stored shards: every microbatch's ops gather them again",
           ("tests/shardings/pipeline/test_compose.py::test_zero3_in_a_stage_gathers_once_per_step",)),
    Mutant("constants-not-replicated-on-the-dtensor-path", "shardings/step/dtensor_path.py",
           "use(ctx.mesh, ctx.layout), implicit_replication(), ",
           "use(ctx.mesh, ctx.layout), ",
           "a causal mask or arange made inside the loss stops the DTensor path (mixed torch.Tensor and DTensor)",
           ("tests/shardings/step/test_constants.py::test_a_model_that_makes_its_mask_and_positions_as_plain_tensors_equals_one_device",)),
    Mutant("constants-not-replicated-in-pipeline-stages", "shardings/step/pipeline_path.py",
           "    with implicit_replication():",
           "    with dtensor_errors():",
           "a causal mask or arange made inside a pipeline stage stops it (mixed torch.Tensor and DTensor)",
           ("tests/shardings/step/test_constants.py::test_a_model_that_makes_its_mask_and_positions_as_plain_tensors_equals_one_device",)),
    # -- MoE: router and capacity -----------------------------------------------------------------------
    Mutant("moe-capacity-floor", "models/moe.py",
           "return min(seq, math.ceil(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))",
           "return min(seq, int(cfg.capacity_factor * seq * cfg.top_k / cfg.experts))",
           "capacity rounds the fair share down instead of up",
           (f"{T_MOE_HAND}test_capacity_by_hand",)),
    Mutant("moe-slot-positions-one-based", "models/moe.py",
           "position = ((order.cumsum(1) - 1) * order).sum(-1)",
           "position = (order.cumsum(1) * order).sum(-1)",
           "queue positions count from 1: each expert keeps one assignment fewer than its capacity",
           (f"{T_MOE_HAND}test_drops_earlier_tokens_first_by_hand", T_MOE)),
    Mutant("moe-router-weights-not-renormalized", "models/moe.py",
           "weights = top_p / top_p.sum(-1, keepdim=True)",
           "weights = top_p",
           "the chosen experts' weights are the raw router probabilities, not renormalized over the top k",
           (f"{T_MOE_HAND}test_top_k_routing_and_renormalized_weights_by_hand", T_MOE)),
    Mutant("moe-aux-of-the-last-block-only", "models/moe.py",
           "        return x, ({k: total[k] + v for k, v in aux.items()} if total else aux)",
           "        return x, aux",
           "the model's aux losses are the last MoE block's instead of the sum over its MoE blocks",
           ("tests/models/test_moe_reference.py::"
            "test_logits_loss_and_gradients_equal_mixtral_and_the_documented_aux_losses",)),
    # -- vocab-parallel cross-entropy -------------------------------------------------------------------
    Mutant("vocab-max-shift-summed", "shardings/ops/vocab_parallel.py",
           'shift = reduce(block.detach().amax(-1), "max")',
           'shift = reduce(block.detach().amax(-1), "sum")',
           "the logsumexp shift sums the blocks' maxima instead of taking their max (exact in math; exp underflows)",
           ("tests/shardings/ops/test_vocab_parallel.py::"
            "test_vocab_parallel_cross_entropy_on_logits_of_magnitude_1e4_equals_one_device_and_torch",)),
    Mutant("vocab-target-not-all-reduced", "shardings/ops/vocab_parallel.py",
           'target = reduce(block.gather(-1, idx[..., None]).squeeze(-1) * hit, "sum")',
           "target = block.gather(-1, idx[..., None]).squeeze(-1) * hit",
           "the target logit is not all-reduced: ranks without the label subtract 0",
           (T_NLL,)),
    # -- the optimizer ----------------------------------------------------------------------------------
    Mutant("adam-bias2-not-sqrt", "core/optim/transforms.py",
           "bias1, bias2_sqrt = _one_minus_pow(b1, t), _one_minus_pow(b2, t).sqrt()",
           "bias1, bias2_sqrt = _one_minus_pow(b1, t), _one_minus_pow(b2, t)",
           "Adam divides the root second moment by 1 - b2^t instead of its square root",
           ("tests/core/optim/test_aliases.py::test_adamw_matches_torch",)),
    Mutant("fused-adamw-ignores-mask", "core/optim/fused.py",
           "weight_decay=weight_decay if decay else 0.0, eps=eps",
           "weight_decay=weight_decay, eps=eps",
           "the fused AdamW step decays every parameter, ignoring the weight-decay mask",
           ("tests/core/optim/test_fused.py::test_fused_step_equals_update_then_apply",)),
    # -- checkpoint resharding --------------------------------------------------------------------------
    Mutant("ckpt-placements-reversed", "shardings/checkpoint/tensors.py",
           "return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)",
           "return distribute_tensor(local, like.device_mesh, like.placements[::-1], src_data_rank=None)",
           "a simulated load lays each tensor out with the target's placements in reversed mesh-dim order",
           (f"{T_CKPT}::test_a_simulated_load_onto_a_2d_mesh_puts_each_block_on_its_rank",
            f"{T_CKPT}::test_simulated_ranks_save_and_load_across_meshes")),
    Mutant("ckpt-loads-whole-on-real-ranks", "shardings/checkpoint/tensors.py",
           "return torch.empty_like(x)",
           "return torch.empty(x.shape, dtype=x.dtype)",
           "a load on real ranks reads every tensor whole into a plain tensor instead of each rank's shards",
           (f"{T_CKPT}::test_resharding_matrix_across_layouts_meshes_world_sizes_and_one_device",)),
    # -- mixed precision and offload ---------------------------------------------------------------------
    Mutant("mp-gather-before-cast", "shardings/step/local_step.py",
           "return fc.launch_gather(self.comm, [self.cast.to_compute(self.shards[i].detach()) for i in b],",
           "return fc.launch_gather(self.comm, [self.shards[i].detach() for i in b],",
           "ZeRO-3 gathers the fp32 shards and casts after: the gather moves twice the bytes",
           (f"{T_MP}::test_zero_gathers_compute_dtype_bytes_and_reduces_in_the_reduce_dtype",)),
    Mutant("mp-reduce-in-compute-dtype", "shardings/step/local_step.py",
           "else owner.cast.to_reduce(g)",
           "else g",
           "a ZeRO-3 bucket's gradients are reduce-scattered in the compute dtype, not the reduce dtype",
           (f"{T_MP}::test_zero_gathers_compute_dtype_bytes_and_reduces_in_the_reduce_dtype",)),
    Mutant("mp-master-not-updated", "shardings/step/local_step.py",
           "weights = [fc.dtensor(x, dm, pl, p) for x, p, pl in zip(new, params, targets)]",
           "weights = list(params)",
           "ZeRO-1/2 under bf16: the compute copy is updated but the fp32 master in the optimizer state is not",
           (f"{T_MP}::test_data_and_tensor_parallel_layouts_match_the_reference_under_the_same_policy",)),
    Mutant("mp-master-copy-off", "shardings/step/local_step.py",
           "new = [master.to_compute(x) for x in new]",
           "new = [master.to_compute(x * 1.01) for x in new]",
           "ZeRO-1/2 under bf16: the stored compute copy is 1% off the updated fp32 master",
           (f"{T_MP}::test_zero1_2_store_the_bf16_copy_of_the_sharded_fp32_master",)),
    Mutant("mp-skip-ignores-inf", "shardings/step/mixed.py",
           "return float(unwrap(flag)) == 0.0",
           "return True",
           "fp16 loss scaling never sees a non-finite gradient: the step is applied and the scale never drops",
           (f"{T_MP}::test_fp16_skips_a_step_with_an_inf_gradient_on_one_rank_and_halves_the_scale",)),
    # -- faults: non-finite gradients, hangs, failed saves (the drills; tests/experiments/test_drill.py) ----
    Mutant("finite-names-the-last-leaf", "shardings/step/finite.py",
           "for path, g in tree.flatten_with_path(grads)[0]:",
           "for path, g in reversed(tree.flatten_with_path(grads)[0]):",
           "a step with several non-finite gradients names the last bad leaf, not the first",
           ("tests/shardings/step/test_finite.py",)),
    Mutant("watchdog-silent-never", "shardings/runtime/watchdog.py",
           "if rank != me and now - last > after_s:",
           "if rank != me and now - last > 100 * after_s:",
           "a stopped peer is named (and a wait without deadline ended) only after 100 timeouts",
           ("tests/shardings/runtime/test_watchdog.py",)),
    Mutant("save-disk-error-unexplained", "shardings/checkpoint/saving.py",
           "    except (OSError, CheckpointException) as e:\n        steps = _steps(root)",
           "    except CheckpointException as e:\n        steps = _steps(root)",
           "a full or read-only disk during the commit surfaces as a bare OSError, not the CheckpointError",
           ("tests/shardings/checkpoint/test_save_faults.py",)),
    Mutant("offload-grads-stay-on-device", "shardings/step/local_step.py",
           "        local_grads = host.to_host(local_grads)",
           "        local_grads = local_grads",
           "with the optimizer offloaded, the host update reads the gradients where they are, on the device",
           ("tests/shardings/residency/test_offload.py::test_offloaded_layouts_equal_their_device_twins_bitwise_and_move_"
            "exactly_their_bytes",)),
    # -- the compiled step (train_step(jit=True)) ---------------------------------------------------------
    Mutant("jit-block-off-by-one-percent", "shardings/step/compiled.py",
           "block=lambda p, x, i: block(_resolved(p), x, i))",
           "block=lambda p, x, i: tree.map(lambda y: y * 1.01, block(_resolved(p), x, i)))",
           "each compiled block's output (every leaf: a MoE block's carry and aux loss) is 1% too large (a wrong "
           "graph only jit=True runs)",
           ("tests/shardings/step/test_jit_equivalence.py::test_compiled_layouts_under_bf16_match_the_reference_"
            "under_the_same_policy",  # the bf16 run and its fp32 twin: the twin catches it
            "tests/shardings/step/test_jit_equivalence.py::test_the_issues_layouts_compiled_train_like_one_device")),
    Mutant("jit-shared-compile-cache", "shardings/step/compiled.py",
           "        self.cache = rank_compile_cache(mesh)",
           "        self.cache = None",
           "every rank compiles into the one inductor cache: where inductor's FX graph cache is used, a warm rank "
           "loads another rank's code (a Shard's offset baked in): gated_conv under cp computes wrong values "
           "silently on a warm run (survived while inductor_with's decomposition table bypassed that cache)",
           ("tests/shardings/step/test_jit.py::test_one_graph_per_block_no_recompiles_a_shape_change_error_and_the_"
            "fallback_warning",
            "tests/zoo/test_zoo_real.py::test_a_warm_compile_cache_serves_each_rank_its_own_code")),
    Mutant("jit-zb-weight-grad-off-by-one-percent", "shardings/pipeline/backward.py",
           "            for edge, g in pending.computed.get(node, ()):  # below a compiled node: what B computed\n"
           "                edges.append(edge)\n                grads.append(g)",
           "            for edge, g in pending.computed.get(node, ()):  # below a compiled node: what B computed\n"
           "                edges.append(edge)\n                grads.append(g * 1.01)",
           "W's weight gradients under a compiled block 1% too large (zero-bubble schedules under jit=True)",
           ("tests/shardings/step/test_jit_pipeline.py::test_zero_bubble_split_of_a_compiled_block_runs_its_backward_"
            "once_and_equals_the_whole_backward_bitwise",
            "tests/shardings/step/test_jit_pipeline.py::test_every_schedule_compiles_one_block_graph_without_breaks_or_"
            "recompiles_and_equals_its_eager_twin",
            # against the reference: zero3+pp (ZB-H1) and tp+pp (ZB-V)
            "tests/shardings/step/test_jit_equivalence.py::test_the_issues_layouts_compiled_train_like_one_device")),
    # -- the planner: the estimate term by term, the ranking's scale, the search's budget (issue 43) --------------
    Mutant("estimate-tp-all-reduce-forward-only", "shardings/planner/comm_terms.py",
           '            for phase, n in (("forward", 2 * per + m), ("backward", 2 * per + m + again)):',
           '            for phase, n in (("forward", 2 * per + m), ("backward", m + again)):',
           "the estimate counts tensor parallelism's residual all-reduces in forward only (2 a block, not 4)",
           ("tests/shardings/planner/test_estimate_terms.py::test_each_estimate_term_is_within_its_bound_of_the_"
            "exact_step[dp+tp dp2_tp2 fp32]",)),
    Mutant("estimate-activations-split-over-tp-without-sp", "shardings/planner/memory_terms.py",
           "        return (part.saved_residual / (t if sp else 1) + rest / t) / c",
           "        return (part.saved_residual / t + rest / t) / c",
           "the estimate counts the residual stream's saved activations as split over tp without sp (it is whole)",
           ("tests/shardings/planner/test_estimate_terms.py::test_each_estimate_term_is_within_its_bound_of_the_"
            "exact_step[tp+pp pp2_tp2 1f1b m2 fp32]",)),
    Mutant("ranking-estimates-rescaled-by-an-exact-run", "shardings/planner/search.py",
           "        ranked.append(r)\n",
           "        ranked.append(Row(r.prediction, dataclasses.replace(r.timing, total=r.timing.total * (\n"
           "            checked[0].ratios[\"step\"] if checked else 1.0))))\n",
           "every estimated row is rescaled by the first exact run's ratio of exact to estimated step time (ranked on "
           "another candidate's scale)",
           ("tests/shardings/planner/test_ranking.py::test_rows_rank_on_their_own_best_known_prediction",)),
    Mutant("search-budget-ignores-the-price", "shardings/planner/search.py",
           "            if started - exact_start + units * rate > budget_s:",
           "            if started - exact_start > budget_s:",
           "the search starts an exact run whose price ends past the budget (it checks only the time spent)",
           ("tests/shardings/planner/test_search.py::test_no_exact_run_starts_whose_price_ends_past_the_budget",
            "tests/shardings/planner/test_search.py::test_a_budget_that_admits_exactly_n_exact_runs_sees_n")),
    Mutant("search-price-ignores-blocks", "shardings/planner/exact.py",
           "        return sum(L * k for L in (la, la + period) for k in ks)",
           "        return sum(2 * k for L in (la, la + period) for k in ks)",
           "an exact run's price does not grow with the blocks it runs on fake tensors",
           ("tests/shardings/planner/test_search.py::test_the_price_of_an_exact_run_grows_with_blocks_times_"
            "microbatches",)),
    Mutant("estimate-sp-backward-gathers-counted-in-forward", "shardings/planner/comm_terms.py",
           '            for phase, gathers, scatters in (("forward", 2 * per + m, 2 * per + m),\n'
           '                                             ("backward", 2 * per + m + 2 * again, 2 * per + m + again)):',
           '            for phase, gathers, scatters in (("forward", 4 * per + 2 * m, 2 * per + m),\n'
           '                                             ("backward", 2 * again, 2 * per + m + again)):',
           "the estimate counts sequence parallelism's backward all-gathers in forward (none in backward): every "
           "kind × axis row and the step's total bytes unchanged, only the phases wrong",
           ("tests/shardings/planner/test_estimate_terms.py::test_each_estimate_term_is_within_its_bound_of_the_"
            "exact_step[zero1+tp+sp dp2_tp2 accum2 bf16]",)),
    Mutant("estimate-zero3-regather-counted-in-forward", "shardings/planner/comm_terms.py",
           '            gathers = {"forward": gathers_per_step,\n'
           '                       "backward": gathers_per_step if leaf.in_blocks and not layout.pipelined else 0}',
           '            gathers = {"forward": gathers_per_step * (2 if leaf.in_blocks and not layout.pipelined else '
           '1),\n                       "backward": 0}',
           "the estimate counts ZeRO-3's backward re-gather of each block in forward (the same bytes a step)",
           ("tests/shardings/planner/test_estimate_terms.py::test_each_estimate_term_is_within_its_bound_of_the_"
            "exact_step[zero3 dp4 fp32]",)),
    Mutant("fake-step-no-update-phase", "shardings/planner/fake_step.py",
           '        phase = "backward" if backward else "forward" if clock < counter.last_backward else "update"',
           '        phase = "backward" if backward else "forward"',
           "the fake step counts the collectives after backward (reductions left after it, ZeRO-1/2's gather of the "
           "updated parameters) as forward's",
           ("tests/shardings/planner/test_estimate_terms.py::test_each_estimate_term_is_within_its_bound_of_the_"
            "exact_step[dp+tp dp2_tp2 fp32]",)),
    Mutant("regather-hides-saved-activations", "shardings/residency/gather_params.py",
           "            return t if self.outer is None else _Passed(self.outer[0](t), self.outer[1])",
           "            return t",
           "a step's ZeRO-3 re-gather hooks hide the activations it saves from the hooks around the step: the "
           "planner's fake step measures no saved activations without pp",
           ("tests/shardings/planner/test_estimate_terms.py::test_without_pp_the_step_measures_the_saved_"
            "activations_the_estimate_counts[dp dp4 fp32]",)),
    # -- the experiments' command lines and the planner on a researcher's model ------------------------------
    Mutant("plan-fake-strided-shard-on-fake-tensors", "shardings/planner/fake_step.py",
           "with mode, _strided_shard_sizes_on_ints():",
           "with mode:",
           "the planner's fake steps compute torch's strided-shard indices on fake tensors: every tp candidate of a "
           "model with F.cross_entropy on vocab-sharded logits or an einsum over heads fails (data-dependent)",
           ("tests/experiments/test_plan_cli.py::test_explain_runs_a_researchers_loss_under_tp_on_fake_tensors",)),
    Mutant("launch-no-main-guard-check", "shardings/runtime/launch.py",
           "    _check_main_guard()\n",
           "",
           "launch from an unguarded script's top level starts workers that re-run the script and die unexplained",
           ("tests/shardings/runtime/test_launch.py::test_a_script_without_the_main_guard_is_told_before_any_process_"
            "starts",)),
    Mutant("equivalence-cli-first-layout-only", "experiments/equivalence.py",
           "layouts=[s.layout for s in setups]",
           "layouts=[first.layout]",
           "the equivalence command line checks only the first of the layouts it was given",
           ("tests/experiments/test_equivalence.py::test_several_layouts_in_one_call_against_one_reference_under_"
            "bf16_and_its_twin",)),
    Mutant("layout-auto-hydra-not-set-aside", "experiments/auto.py",
           "    GlobalHydra.instance().clear()\n",
           "",
           "layout=auto composes its cluster inside the train app's running Hydra (GlobalHydra is already initialized)",
           ("tests/experiments/test_plan_cli.py::test_layout_auto_trains_the_winner_as_the_docs_command_runs_it",)),
    # -- real-rank pipelines: the message templates (simulated => real) -----------------------------------------
    Mutant("wire-templates-on-meta", "shardings/pipeline/wire.py",
           "    return next(found, torch.device(\"cpu\"))",
           "    return torch.device(\"meta\")",
           "the real-rank pipeline's message templates run the stages on meta tensors: a constant the model makes "
           "(rotary tables from torch.arange) meets them and the step crashes where simulated ranks passed",
           ("tests/shardings/pipeline/test_wire.py::test_templates_run_constants_the_stages_make_and_blocks_held_by_"
            "other_ranks",)),
    Mutant("wire-sends-carry-as-it-came", "shardings/pipeline/wire.py",
           "        if self.placements is None:\n            return leaves\n        out = []",
           "        if True:\n            return leaves\n        out = []",
           "a real-rank pipeline message is packed in the layout its carry came in, not its carry_names' (a replicated "
           "aux loss, a Partial input gradient): the receiver reads other bytes than were sent",
           ("tests/shardings/pipeline/test_wire.py::test_a_message_is_laid_out_as_its_template_says_whatever_layout_"
            "the_carry_came_in",)),
    # -- the experiments' run record (experiments.resume, experiments.sweep) ----------------------------------
    Mutant("resume-ignores-the-schedule", "experiments/resume.py",
           'TRAINING_KEYS = ("steps", "optim", "data", "model.name", "model.config", "precision", "seed")',
           'TRAINING_KEYS = ("optim", "data", "model.name", "model.config", "precision", "seed")',
           "a resume with another steps= (so another learning-rate schedule) continues silently",
           ("tests/experiments/test_resume.py::test_a_resume_that_changes_the_experiment_is_refused_with_the_keys_"
            "and_the_flag",)),
    Mutant("sweep-skipped-job-passes", "experiments/sweep.py",
           'bad = sum(n for s, n in counts.items() if s != "ran" and not (s == "skipped" and allow_skipped))',
           'bad = sum(n for s, n in counts.items() if s == "failed")',
           "a sweep with an impossible (skipped) job exits 0 though sweep.allow_skipped is false",
           ("tests/experiments/test_sweep_status.py::test_an_impossible_combination_is_skipped_the_sweep_fails_and_"
            "the_report_lists_every_job",)),
    Mutant("jit-comm-inside-graphs-uncounted", "shardings/step/compiled.py",
           "                if mode.ignore_compile_internals():\n                    kept.enter_context(mode)",
           "                if mode.ignore_compile_internals():\n                    pass",
           "under jit=True the counting mode is paused around the compiled blocks: their tp/sp/ep collectives go "
           "uncounted and metrics['comm'] differs from eager's",
           ("tests/shardings/step/test_jit.py::test_one_graph_per_block_no_recompiles_a_shape_change_error_and_the_"
            "fallback_warning",)),
    Mutant("terapipe-prefix-grad-one-percent", "shardings/pipeline/prefix.py",
           "sums = self.sums.pop((s, unit), [None] * len(presents))",
           "sums = [g if g is None else 1.01 * g for g in self.sums.pop((s, unit), [None] * len(presents))]",
           "TeraPipe: the gradient later chunks send an earlier chunk's keys and values is backpropagated 1% too large",
           ("tests/shardings/pipeline/test_seq_chunks.py::test_the_executor_equals_one_device_over_chunk_counts_and_"
            "uneven_lengths",
            "tests/shardings/pipeline/test_terapipe.py::test_pp_with_uneven_chunks_equals_one_device")),
    # -- #39: the step's context, one home per decision -------------------------------------------------------
    Mutant("batch-rows-check-skips-divisibility", "shardings/step/batching.py",
           "    if rows < 1 or rows % parts:",
           "    if rows < 1:",
           "a global batch that does not split over data ranks × microbatches is not refused (the one check)",
           ("tests/shardings/step/test_train_step.py::test_batch_not_divisible_by_data_ranks_times_accumulation_is_a_"
            "clear_error",)),
    Mutant("pipeline-microbatches-ignore-accum-steps", "shardings/pipeline/plan.py",
           "    return microbatches if microbatches is not None else accum_steps if accum_steps > 1 else pp",
           "    return microbatches if microbatches is not None else pp",
           "a pipelined run's microbatch default forgets accum_steps (the one home of that default)",
           ("tests/shardings/pipeline/test_plan.py::test_defaults_are_written_once",)),
    Mutant("train-step-takes-gone-keywords-silently", "shardings/step/train_step.py",
           "    for name in gone:",
           "    for name in ():",
           "train_step accepts schedule=/microbatches=/stage_sizes=/virtual_stages= and ignores them",
           ("tests/shardings/pipeline/test_train_step.py::test_bad_input_is_refused_before_any_work",)),
    Mutant("pipeline-result-not-kept", "shardings/step/train_step.py",
           "loss, g, tokens, self.last = pipeline_path.grads(ctx, plan, params, batch, scale)",
           "loss, g, tokens, _ = pipeline_path.grads(ctx, plan, params, batch, scale)",
           "the step drops the Result the pipeline path returns: metrics['pipeline'] has no saved peaks",
           ("tests/shardings/pipeline/test_train_step.py::test_metrics_count_p2p_per_rank_and_report_the_pipeline",)),
    # -- blind spots, third pass (issue #43.4-6): what a report states, hashes on real ranks, ZeRO-3's forward -------
    Mutant("detection-limit-of-the-best-leaf", "shardings/testing/power.py",
           "leaf = max(counted, key=counted.get)",
           "leaf = min(counted, key=counted.get)",
           "a report states its best-caught leaf's detection limit instead of its worst's",
           ("tests/shardings/testing/test_power.py::"
            "test_an_error_at_the_stated_limit_is_caught_in_every_leaf_and_a_rung_below_passes_in_the_worst",)),
    Mutant("ckpt-a-rank-skips-its-hash-share", "shardings/checkpoint/files.py",
           "elif i % world == rank and _sha256(file) != want[\"sha256\"]:",
           "elif i % world == rank and rank != 1 and _sha256(file) != want[\"sha256\"]:",
           "on a multi-process load rank 1 hashes none of its share: a corrupted file of its share loads",
           ("tests/shardings/checkpoint/test_checkpoint_hashes_real.py",)),
    Mutant("zero3-dtensor-forward-keeps-gathered-weights", "shardings/residency/gather_buckets.py",
           "if k not in kept and regather is not None:",
           "if k in kept and regather is not None:",
           "ZeRO-3 on the DTensor path: autograd saves every block's gathered weights (data parallelism's forward)",
           ("tests/shardings/residency/test_zero3_peak_memory.py::"
            "test_the_forward_alone_holds_one_gathered_bucket_whatever_the_depth[zero3-dtensor]",)),
    Mutant("zero3-forward-keeps-every-block", "shardings/residency/lazy_params.py",
           "        self._drop_blocks()  # the previous block's weights go",
           "        pass  # the previous block's weights go",
           "ZeRO-3's forward keeps every block's gathered weights live until it ends (both paths)",
           ("tests/shardings/residency/test_zero3_peak_memory.py::"
            "test_the_forward_alone_holds_one_gathered_bucket_whatever_the_depth[zero3-local]",)),
    Mutant("comm-ppermute-counted-as-all-to-all", "shardings/comm/accounting.py",
           "        if splits and x.dim() and max(_ints(x.shape[0])) == 1:",
           "        if False:",
           "a ppermute (one row to one peer) is counted as an all_to_all: a compiled cp step's ring, which runs "
           "without recorded_as, reports other kinds than its eager step",
           ("tests/shardings/comm/test_accounting.py::"
            "test_a_ppermute_is_counted_as_one_ppermute_of_its_buffer_without_recorded_as",)),
    Mutant("memory-png-ignores-peak-parts", "experiments/memory_plot.py",
           '    if summary.get("peak_parts"):',
           "    if False:",
           "memory.png shows activations and buffers as one band although the run split its peak by role",
           ("tests/experiments/test_report.py::test_memory_png_stacks_the_peak_by_role_and_marks_each_ranks_peak",)),
    Mutant("peak-by-role-ignores-measured-activations", "shardings/planner/search.py",
           "        return corrected(StepMemory(*[0.0] * len(ROLES)), held, peak, saved)",
           "        return corrected(StepMemory(*[0.0] * len(ROLES)), held, peak, 0.0)",
           "a pipelined run's measured saved activations are dropped: its peak's activations show as buffers",
           ("tests/experiments/test_report.py::test_sweep_then_report",)),
    # -- simulated ranks' per-rank loop (shardings.runtime.fastlocal) ------------------------------------
    Mutant("fastlocal-rng-never-restored", "shardings/runtime/fastlocal.py",
           "        hit = not isinstance(func, _lt.OpOverload) or _SEEDED in func.tags",
           "        hit = False",
           "the RNG state is never restored between ranks: each simulated rank draws different random numbers",
           ("tests/shardings/runtime/test_fastlocal.py::test_fast_loop_equals_torchs_loop",)),
    Mutant("fastlocal-rank-args-off-by-one", "shardings/runtime/fastlocal.py",
           "        rank_args = args if args_at is None else args_at(r)",
           "        rank_args = args if args_at is None else args_at((r + 1) % len(ranks))",
           "each rank computes on its neighbour's local values",
           ("tests/shardings/runtime/test_fastlocal.py::test_fast_loop_equals_torchs_loop",)),
    # -- the zoo's planner column and experiments.train's data check (issue #40) ------------------------------------
    Mutant("row-tokens-drops-the-class-token", "shardings/planner/model_profile.py",
           "    return residual[0].numel() // dim",
           "    return residual[0].numel() // dim - 1",
           "a Config without seq_len is planned one token short a row (the ViT's class token left out)",
           ("tests/zoo/test_zoo_planner.py::test_the_planner_measures_the_tokens_of_a_model_without_seq_len",)),
    Mutant("data-check-takes-any-labels-shape", "experiments/data.py",
           "v.ndim == 2 and v.shape == tokens.shape",
           "v.ndim >= 1",
           "experiments.train takes a classifier's one label per row for next-token labels: the fix it names is the "
           "vocab, which cannot make it train",
           ("tests/zoo/test_zoo_planner.py::"
            "test_layout_auto_on_a_model_the_data_cannot_feed_gives_its_declared_error[encoder auto]",)),
    # -- the planner's exact runs of TeraPipe candidates (issue #44) -----------------------------------------
    Mutant("planner-exact-chunked-probes-whole", "shardings/planner/exact.py",
           "              seq_chunks=cand.seq_chunks)\n",
           "              seq_chunks=1)\n",
           "a TeraPipe candidate's peak probes run each rank's whole-sequence program: its activations are unchunked",
           ("tests/shardings/planner/test_seq_chunks.py::"
            "test_the_exact_run_of_a_chunked_candidate_runs_its_chunks_as_its_estimate_predicts",)),
    Mutant("planner-exact-chunked-comm-steps-whole", "shardings/planner/exact.py",
           "return build(cand.schedule, 1, microbatches, seq_chunks=cand.seq_chunks), True, True",
           "return None",
           "a TeraPipe candidate's comm steps run whole sequences: its ops and collectives are counted unchunked",
           ("tests/shardings/planner/test_seq_chunks.py::"
            "test_the_exact_run_of_a_chunked_candidate_runs_its_chunks_as_its_estimate_predicts",)),
    Mutant("terapipe-first-offset-misses-a-chunk", "shardings/pipeline/runner.py",
           "offset = sum(seq_length(self.microbatches[u]) for u in range(unit - unit % self.k, unit))",
           "offset = sum(seq_length(self.microbatches[u]) for u in range(unit - unit % self.k, unit - 1))",
           "the executor passes a chunk's prefix_first the offset of the chunk before it (learned positions shifted)",
           ("tests/zoo/test_zoo_terapipe.py::test_decoder_with_uneven_chunks_equals_one_device",)),
    Mutant("terapipe-chunked-loss-offset-stays-zero", "shardings/pipeline/stages.py",
           "            offset += seq_length(chunk)\n",
           "            offset += 0\n",
           "Stages.chunked_loss runs every chunk's prefix_first at offset 0 (positions from 0 in every chunk)",
           ("tests/zoo/test_zoo_terapipe.py::"
            "test_gpt2_chunks_take_their_learned_positions_at_their_offset_with_no_batch_key",)),
    Mutant("terapipe-prefix-graphs-at-torchs-limit", "shardings/step/compiled.py",
           "PREFIX_GRAPHS = 64",
           "PREFIX_GRAPHS = 8",
           "a compiled prefix block keeps torch's recompile limit: past 8 chunks per sequence jit fails (or runs "
           "eager)",
           ("tests/shardings/step/test_jit_pipeline.py::"
            "test_terapipe_compiles_a_prefix_graph_per_chunk_position_past_torchs_recompile_limit",)),
    # -- ops DTensor could not trace under jit=True (issue #40's declared compile failures) -------------------
    Mutant("jit-assert-async-no-strategy", "shardings/ops/assert_strategies.py",
           "for _op in ASSERT_OPS:",
           "for _op in ():",
           "aten._assert_async has no DTensor strategy: F.one_hot fails to compile on DTensors (moe_top2 under jit)",
           ("tests/shardings/ops/test_assert_strategies.py",
            "tests/shardings/step/test_jit_traced_ops.py")),
    Mutant("assert-async-checks-partial-shares", "shardings/ops/assert_strategies.py",
           "Replicate() if p.is_partial() else p for p",
           "p for p",
           "a Partial DTensor is checked on each rank's share, not on the value it stands for",
           ("tests/shardings/ops/test_assert_strategies.py::"
            "test_a_partial_dtensor_is_checked_on_its_sum_not_on_each_ranks_share",)),
    Mutant("jit-strided-shard-offsets-traced", "shardings/runtime/compat.py",
           "size, _ = placement.local_shard_size_and_offset(*args, offset_mode=_NO_OFFSETS)",
           "size, _ = placement.local_shard_size_and_offset(*args)",
           "pricing a _StridedShard's redistribution computes its offsets: unbacked SymInts under dynamo, and "
           "torch.einsum over 3-D weights on a 2-D mesh fails to compile (PendingUnbackedSymbolNotFound)",
           ("tests/shardings/step/test_jit_traced_ops.py",)),
    # -- ZeRO-3 under remat: one re-gather a block in backward, no gathered copy kept from forward ---------------
    Mutant("zero3-remat-cast-resolves-placeholders", "shardings/residency/lazy_params.py",
           "    if func is not torch.Tensor.to or not isinstance(args[0], Lazy):",
           "    if True:",
           "a policy's cast to the compute dtype resolves every ZeRO-3 placeholder before the loss runs: under bf16 "
           "the forward holds every block's gathered weights, remat's checkpoints keep them until backward (no "
           "re-gather)",
           ("tests/shardings/residency/test_zero3_remat.py::test_backward_gathers_each_block_once",
            "tests/shardings/residency/test_zero3_remat.py::"
            "test_no_gathered_weights_live_from_a_blocks_forward_to_its_backward")),
    Mutant("zero3-remat-prefetch-in-forward-order", "shardings/residency/lazy_params.py",
           "nxt = k - 1 if self.in_backward else k + 1",
           "nxt = k + 1",
           "a block recomputed in backward (remat) prefetches the block after it, which backward has already passed: "
           "L - 1 wasted gathers, each held until the step ends",
           ("tests/shardings/residency/test_zero3_remat.py::test_backward_gathers_each_block_once",
            "tests/shardings/residency/test_zero3_remat.py::"
            "test_the_peak_holds_at_most_two_gathered_blocks_whatever_the_depth")),
    Mutant("zero3-placeholder-gradient-unchecked", "shardings/residency/lazy_params.py",
           "        stray = [p for p in self.made if p.requires_grad]",
           "        stray = []",
           "a torch.autograd.Function given a ZeRO-3 placeholder (apply() bypasses its gather) loses the weight's "
           "gradient without a word: the step no longer asks autograd for the placeholders' gradients",
           ("tests/shardings/residency/test_function_on_placeholder.py",)),
    Mutant("zero3-bucket-materialized-unused-grad", "shardings/residency/gather_buckets.py",
           "        ctx.set_materialize_grads(False)\n",
           "",
           "a ZeRO-3 bucket's backward gets autograd's materialized zeros (a plain tensor) for a leaf the loss never "
           "uses: zero3+tp+sp crashes, eager and jit",
           ("tests/shardings/step/test_jit_zoo_bugs.py::"
            "test_an_unused_parameter_under_zero3_tp_sp_trains_like_one_device",)),
    Mutant("inductor-cat-keeps-input-strides", "shardings/ops/compile_decompositions.py",
           "    return out if out.is_contiguous(memory_format=layout) else out.contiguous(memory_format=layout)",
           "    return out",
           "inductor's aten.cat of one tensor keeps a permuted input's strides: a DTensor's local block disagrees "
           "with its global layout, and gpt2's attention fails to compile under zero3+tp ('Cannot view a tensor')",
           ("tests/shardings/step/test_jit_zoo_bugs.py::test_inductors_cat_of_one_tensor_is_laid_out_as_aten_cat",
            "tests/shardings/step/test_jit_zoo_bugs.py::"
            "test_the_layer_compiled_by_inductor_with_unused_parameters_trains_like_one_device")),
    Mutant("jit-inductor-without-dtensor-decompositions", "shardings/step/compiled.py",
           'backend=INDUCTOR if backend == "inductor" else backend',
           "backend=backend",
           "train_step(jit=True) compiles with inductor's own decompositions: a one-tensor torch.cat on DTensors "
           "fails to compile ('Cannot view a tensor with shape')",
           ("tests/shardings/step/test_jit_zoo_bugs.py::"
            "test_the_layer_compiled_by_inductor_with_unused_parameters_trains_like_one_device",)),
    Mutant("ring-backward-kv-sent-alone", "shardings/ops/ring_attention.py",
           "                if step < n - 1:  # K/V and dK/dV as one message: _pack says why\n"
           "                    kv, dkv = _unpack(ring.send(_pack(kv, dkv)), kv, dkv)\n"
           "                else:\n"
           "                    dkv = ring.send(dkv)  # the last step brings dK/dV home\n",
           "                if step < n - 1:\n"
           "                    kv = ring.send(kv)\n"
           "                dkv = ring.send(dkv)\n",
           "ring attention's backward re-sends K/V alone (not with dK/dV): the send needs no gradient, so a compiled "
           "step merges it with forward's (or moves it into forward) and keeps the received K/V blocks for backward: "
           "fewer sends than eager, more held",
           (f"{T_RING}::test_ring_passes_kv_cp_minus_one_times_forward_and_kv_dkv_in_backward",
            "tests/shardings/step/test_jit.py::"
            "test_one_graph_per_block_no_recompiles_a_shape_change_error_and_the_fallback_warning")),
    # -- simulated ranks' intra-op threads (shardings.runtime.simulate, issue #42) -----------------------------------
    Mutant("simulate-keeps-the-callers-threads", "shardings/runtime/simulate.py",
           "    torch.set_num_threads(min(threads, rank_threads(world_size)))",
           "    torch.set_num_threads(threads)",
           "simulated ranks run every tiny per-rank op on the caller's whole thread pool (10x slower under load)",
           ("tests/shardings/runtime/test_simulate_reset.py::"
            "test_simulated_ranks_get_a_real_ranks_threads_and_give_them_back",)),
    Mutant("fastlocal-factory-stays-plain", "shardings/runtime/fastlocal.py",
           "    if not local and (self._disable or any(isinstance(a, torch.Tensor) for a in flat)):",
           "    if not local:",
           "inside simulate a factory function (torch.ones, torch.zeros: no tensor argument) returns a plain tensor, "
           "not a LocalTensor of one tensor per rank: an in-place write of rank-dependent values into it fails or "
           "mixes ranks",
           ("tests/shardings/runtime/test_fastlocal.py::test_writes_views_foreach_and_collectives_equal_torchs_loop",)),
    Mutant("fastlocal-split-pads-dim-0", "shardings/runtime/fastlocal.py",
           "    dim = 0 if len(flat) < 3 else _lt._map_to_rank_local_val(flat[2], first)",
           "    dim = 0",
           "a split along dim 1 pads the ranks that got fewer chunks with chunks empty along dim 0: their shapes "
           "differ from torch's loop",
           ("tests/shardings/runtime/test_fastlocal.py::test_split_pads_ranks_with_fewer_chunks_as_torchs_loop",)),
    Mutant("fastlocal-meta-ignores-strides", "shardings/runtime/fastlocal.py",
           "        if t.shape != shape or t.stride() != stride or t.dtype != dtype or t.layout != layout \\\n",
           "        if t.shape != shape or t.dtype != dtype or t.layout != layout \\\n",
           "a LocalTensor whose ranks hold different strides (a transposed shard on one rank) takes the first rank's",
           ("tests/shardings/runtime/test_fastlocal.py::test_local_tensor_metadata_is_torchs",)),
)

# Mutants that change no behaviour a user could observe, each with the reason; they may survive.
EQUIVALENT: dict[str, str] = {}
