"""The published layouts on the H100 profile, bf16, with a small search of estimates (docs/planner.md has the full
searches).

Each published layout must stay a candidate of the full search space (a change to the candidate generator that
loses it fails here), and the small search must say what the full one says of it: ranked (its rank checked), or
dropped with the memory that does not fit (the numbers checked)."""

import shardings
from experiments.build import model
from experiments.plan import CONF, load_cluster
from shardings.planner import Candidate, Space, enumerate_candidates
from shardings.planner.ranking import Ranking, gb


def _model(name: str):
    from hydra import compose, initialize_config_dir

    from experiments.config import register

    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name="test"):
        return model(compose("plan", overrides=[f"model={name}"]).model)


def _plan(name: str, cluster: str, batch: tuple[int, int], cands: list[Candidate]) -> Ranking:
    """A search of ``cands`` (the published one first), after checking that the full search would consider it."""
    module, cfg = _model(name)
    machine = load_cluster(cluster)
    space = enumerate_candidates(machine.world, cfg, batch[0], batch[1], per_node=machine.per_node,
                                 space=Space(precisions=("bf16",)))
    assert cands[0] in space, f"{cands[0]} is no longer a candidate of the full search ({len(space)})"
    return shardings.plan(module, cfg, batch, machine, candidates=cands, budget_s=0)  # estimates only


def test_llama3_8b_fsdp_with_remat_is_ranked_and_plain_data_parallel_does_not_fit():
    """torchtitan trains Llama-3 8B on 8 H100s with FSDP and activation checkpointing: ranked (the full search ranks
    it 38th-40th of 592, on fake tensors). Replicated AdamW state (8.03B parameters × 8 bytes) is 64.2 GB a rank."""
    fsdp = Candidate("zero3", (("dp", 8),), 1, None, None, True, "bf16")
    dp = Candidate("dp", (("dp", 8),), 1, None, None, True, "bf16")
    ranking = _plan("llama3_8b", "h100x8", (8, 8192), [fsdp, dp])
    print(f"{fsdp}: rank {ranking.rank_of(fsdp)} of {len(ranking.rows)}")
    assert ranking.rank_of(fsdp) == 1
    why = ranking.dropped[dp]  # the optimizer state alone: 8.03B parameters × 8 bytes, replicated
    assert why.startswith("does not fit:") and "opt_state 64.2 GB" in why


def test_gpt3_175b_zero2_on_dp8_pp4_tp2_is_dropped_for_its_model_state():
    """The seed's layout for GPT-3 175B on 64 GPUs: 22.3B parameters on the busiest model-parallel rank. ZeRO-2 under
    bf16 stores the bf16 copy (2P: 44.7 GB) and shards the fp32 master with Adam's moments (12P/8: 33.5 GB); with
    fp32 gradient shards (11.2 GB) the model state alone is 89.4 GB > 80 GB, whatever the schedule or remat."""
    published = Candidate("zero2+tp+pp", (("pp", 4), ("dp", 8), ("tp", 2)), 64, "1f1b", None, True, "bf16")
    ranking = _plan("gpt3_175b", "h100x64", (1536, 2048), [published])
    why = ranking.dropped[published]
    print(why)
    assert ranking.rank_of(published) is None
    assert why.startswith("does not fit: 89.4 GB > 80 GB of model state alone")
    assert "params 44.7 GB" in why and "opt_state 33.5 GB" in why


def test_llama3_405b_fsdp8_tp8_pp8_interleaved_fits_by_its_estimate():
    """torchtitan's 405B layout on 512 H100s: FSDP 8 × TP 8 (with sequence parallelism) × PP 8, interleaved 1F1B,
    one sequence of 8192 per microbatch. Its estimate counts the stage's blocks gathered (ZeRO-3 inside a stage,
    once a step) and their unreduced bf16 gradients, with one bucket's fp32 copy for the reduction: 52.4 GB a rank,
    27.6 GB of it buffers, under an H100's 80 GB: ranked (80.0 GB and dropped while the pipelined step held the
    step before's gradients and a reduce-dtype copy of them all; docs/planner.md)."""
    published = Candidate("zero3+tp+sp+pp", (("pp", 8), ("dp", 8), ("tp", 8)), 8, "interleaved_1f1b", 2, True,
                          "bf16")
    ranking = _plan("llama3_405b", "h100x512", (64, 8192), [published])
    assert published not in ranking.dropped and ranking.rank_of(published) == 1
    pred = ranking.rows[0].prediction
    print(f"{published}: {gb(pred.peak)}, buffers {gb(pred.memory['buffers'])}")
    assert not pred.exact and gb(pred.peak) == "52.4 GB" and gb(pred.memory["buffers"]) == "27.6 GB"
