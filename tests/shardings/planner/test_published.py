"""The published layouts on the H100 profile, bf16, with a small search (estimates only; docs/planner.md has the
full searches): where the memory goes decides what can run at all, and the planner says so with the numbers."""

import shardings
from experiments.build import model
from experiments.plan import CONF, load_cluster
from shardings.planner import Candidate
from shardings.planner.ranking import Ranking


def _model(name: str):
    from hydra import compose, initialize_config_dir

    from experiments.config import register

    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name="test"):
        return model(compose("plan", overrides=[f"model={name}"]).model)


def _plan(name: str, cluster: str, batch: tuple[int, int], cands: list[Candidate]) -> Ranking:
    module, cfg = _model(name)
    return shardings.plan(module, cfg, batch, load_cluster(cluster), candidates=cands, budget_s=0)


def test_llama3_8b_fsdp_on_one_node_and_plain_data_parallel_does_not_fit():
    """torchtitan trains Llama-3 8B on 8 H100s with FSDP (and activation checkpointing); replicated AdamW state
    (18 bytes per parameter under bf16 with fp32 master and reduction) is 145 GB a rank."""
    fsdp = Candidate("zero3", (("dp", 8),), 1, None, None, True, "bf16")
    dp = Candidate("dp", (("dp", 8),), 1, None, None, True, "bf16")
    ranking = _plan("llama3_8b", "h100x8", (8, 8192), [fsdp, dp])
    assert ranking.rank_of(fsdp) == 1 and not ranking.rows[0].prediction.exact
    why = ranking.dropped[dp]  # the optimizer state alone: 8.03B parameters × 8 bytes, replicated
    assert why.startswith("does not fit:") and "opt_state 64.2 GB" in why


def test_gpt3_175b_zero2_on_dp8_pp4_tp2_keeps_the_bf16_copy_and_shards_the_fp32_master():
    """The seed's layout for GPT-3 175B on 64 GPUs: 22.3B parameters on the busiest model-parallel rank. ZeRO-2 under
    bf16 stores the bf16 copy (2P: 44.7 GB, not the 89.4 GB of a replicated fp32 master) and shards the fp32 master
    with Adam's moments (12P/8: 33.5 GB); with fp32 gradient reduction and the saved activations it still does not
    fit an 80 GB H100 (the paper's bf16 reduction would save 2P/8 more)."""
    published = Candidate("zero2+tp+pp", (("pp", 4), ("dp", 8), ("tp", 2)), 64, "1f1b", None, True, "bf16")
    ranking = _plan("gpt3_175b", "h100x64", (1536, 2048), [published])
    why = ranking.dropped[published]
    assert why.startswith("does not fit:") and "params 44.7 GB" in why and "opt_state 33.5 GB" in why


def test_llama3_405b_fsdp8_tp8_pp8_interleaved_fits():
    """torchtitan's 405B layout on 512 H100s: FSDP 8 × TP 8 (with sequence parallelism) × PP 8, interleaved 1F1B,
    one sequence of 8192 per microbatch. Without sp each microbatch's residual stream stays whole on the 8 tp
    ranks: the same layout as zero3+tp+pp needs 1.6 TB of saved block inputs at 16 microbatches of 16 rows."""
    published = Candidate("zero3+tp+sp+pp", (("pp", 8), ("dp", 8), ("tp", 8)), 8, "interleaved_1f1b", 2, True,
                          "bf16")
    ranking = _plan("llama3_405b", "h100x512", (64, 8192), [published])
    assert ranking.rank_of(published) == 1
    assert ranking.rows[0].prediction.peak < 80e9
