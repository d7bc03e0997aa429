"""``bench tp``'s rank program on a tiny float64 model over two gloo ranks: the collectives it counts
are the formula's, and the two ranks' greedy tokens are one process's (no timing asserted)."""

from __future__ import annotations

import torch
from helpers.checkpoints import tiny_hf_checkpoint

from minillm.bench import tp, tp_cost
from minillm.distributed.launch import run_ranks
from minillm.distributed.loader import read_config

SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
         "intermediate_size": 96}


def test_the_bench_counts_the_formulas_bytes_and_matches_one_process(tmp_path, tiny_tokenizer, capsys):
    source = tiny_hf_checkpoint(tmp_path / "tiny", tiny_tokenizer, "llama", **SHAPE)
    prompts = [[5, 17, 42, 7, 99], [11, 12, 300, 8, 1]]
    new_tokens = 3
    outcomes = run_ranks(tp.measure_ranks, 2, (str(source), "float64", prompts, new_tokens, 1, (1, 2), 2),
                         timeout=30, deadline=120)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error or o.exitcode]
    assert not errors, "\n".join(errors)
    r, config = outcomes[0].value, read_config(source)
    for batch in (1, 2):
        expected = tp_cost.step_bytes(config, 2, batch, 8)
        assert r[f"b{batch}_calls"] == {"all_reduce": 2 * 2 + 1, "all_gather": 1, "broadcast": 2}  # header + step
        assert r[f"b{batch}_bytes"]["all_reduce"] == expected.total_all_reduce_bytes
        assert r[f"b{batch}_bytes"]["all_gather"] == expected.all_gather_bytes
        assert [len(r[f"b{batch}"][phase]) for phase in tp.PHASES] == [1] * len(tp.PHASES)
        tokens = r[f"b{batch}_tokens"]
        assert tokens["1 process"] == tokens["2 ranks"] and len(tokens["2 ranks"]) == batch
        assert all(len(row) == new_tokens + 1 for row in tokens["2 ranks"])
    assert set(outcomes[1].value["rank1_all_reduce_s"]) == {"b1", "b2"}

    summary = tp.summarize(r, outcomes[1].value, config, torch.float64)
    assert summary["batches"] == [1, 2] and summary["b1_same_tokens"] and summary["b2_same_tokens"]
    assert summary["gloo_latency_s"] > 0 and set(summary["rank_share"]) == {2, 3}
    tp.print_tp_report({**summary, "dtype": "float64", "threads": 1, "new_tokens": new_tokens, "rounds": 1,
                        "prompt_tokens": 5, "seconds": 1.0})
    out = capsys.readouterr().out
    assert out.count("the formula's") == 2 and "DIFFERENT" not in out
    assert "greedy tokens the same as 1 process: True" in out and "W=2 pays once" in out
