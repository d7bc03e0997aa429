"""The verify step and the rollback on the paged cache, against the plain forward (float64).

A speculative step feeds a row its last token plus k drafted ones and needs the target's
logits after each; the rejected drafts are then taken back by ``BlockManager.truncate``, without
copying, and the next step must see exactly the kept text (the stale keys past it are simply
overwritten)."""

from __future__ import annotations

import torch
from helpers.checkpoints import tiny_hf_checkpoint

import minillm
from minillm import Engine


def _full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_verify_gives_every_positions_logits_and_truncate_rolls_back(tmp_path, tiny_tokenizer):
    folder = tiny_hf_checkpoint(tmp_path / "tiny", tiny_tokenizer, "llama", vocab_size=tiny_tokenizer.vocab_size)
    model, tok = minillm.load_model(folder, device="cpu", dtype="float64")
    engine = Engine(model, tok, backend="eager", block_size=4)
    runner, manager = engine.runner, engine.manager
    prompt, drafts = tok.encode("the king is dead, long live"), [5, 9, 13, 21, 34]
    manager.add_sequence(0)
    manager.reserve([0], [len(prompt)])
    runner.prefill([0], [prompt])
    free_before = manager.allocator.num_free

    manager.reserve([0], [1 + len(drafts)])  # the last prompt token again is not fed: the drafts follow it
    logits = runner.verify([0], [drafts])
    reference = _full_logits(model, prompt + drafts)
    assert logits.shape == (len(drafts), model.config.vocab_size)
    assert torch.allclose(logits, reference[len(prompt):], atol=1e-10)

    kept = len(prompt) + 2  # two drafts accepted, three rejected
    manager.truncate(0, kept)
    assert manager.lengths[0] == kept and manager.allocator.num_free >= free_before - 1
    text = prompt + drafts[:2]
    manager.reserve([0], [1])
    step = runner.decode([0], [77])
    assert torch.allclose(step[0], _full_logits(model, text + [77])[-1], atol=1e-10)
    manager.free_sequence(0)
    assert manager.allocator.num_free == manager.allocator.num_blocks
