"""Greedy generation three ways, as notebooks 06-08 build it: full recompute, a contiguous KV
cache, a paged KV cache. Teaching references: the engine (``minillm.engine``) is what every user
path runs; these loops are what it is checked against.

All three must produce the same tokens; they differ only in how much work and memory a step
costs. Recompute runs the whole sequence again for every new token (O(t^2) over t tokens);
the caches run only the new token through the model and read earlier keys/values from memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minillm.cache import ContiguousKVCache, PagedKVCache
from minillm.model.llama import Transformer
from minillm.tokenizer.padding import pad_batch


def _check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


@torch.no_grad()
def greedy_recompute(
    model: Transformer,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """The new token ids, stopping after ``max_new_tokens`` or right after ``eos_token_id``."""
    _check_request([input_ids], max_new_tokens)
    ids = torch.tensor([list(input_ids)], device=model.device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(model(ids, last_only=True)[0, -1].argmax())
        new.append(next_id)
        if next_id == eos_token_id:
            break
        ids = torch.cat([ids, torch.tensor([[next_id]], device=model.device)], dim=1)
    return new


@torch.no_grad()
def greedy_contiguous(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """A left-padded batch on a preallocated cache: prefill once, then one token per step."""
    _check_request(prompts, max_new_tokens)
    batch = pad_batch(prompts, pad_id, "left")
    input_ids = batch.input_ids.to(model.device)
    attention_mask = batch.attention_mask.to(model.device)
    cache = ContiguousKVCache(
        model.config, len(prompts), input_ids.shape[1] + max_new_tokens, model.device, model.dtype
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * len(prompts)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(step_ids, attention_mask=attention_mask, cache=cache, last_only=True)
        next_ids = logits[:, -1].argmax(-1)
        for row, token in enumerate(next_ids.tolist()):
            if not done[row]:
                outputs[row].append(token)
                done[row] = token == eos_token_id
        if all(done):
            break
        step_ids = next_ids[:, None]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], dim=1)
    return outputs


@torch.no_grad()
def greedy_paged(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: int | None = None, block_size: int = 16, num_blocks: int | None = None) -> list[list[int]]:
    """Each prompt prefilled alone into its own blocks, then all decoded together; a finished
    sequence hands its blocks back at once. No padding anywhere."""
    _check_request(prompts, max_new_tokens)
    if num_blocks is None:
        num_blocks = sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts)
    cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype)
    outputs: list[list[int]] = [[] for _ in prompts]
    last_token: dict[int, int] = {}
    for seq_id, prompt in enumerate(prompts):
        if max_new_tokens == 0:
            break
        cache.add_sequence(seq_id)
        logits = model(torch.tensor([list(prompt)], device=model.device), paged=cache.prepare([seq_id], len(prompt)), last_only=True)
        last_token[seq_id] = int(logits[0, -1].argmax())
    active = []
    for seq_id, token in last_token.items():
        outputs[seq_id].append(token)
        if token == eos_token_id or max_new_tokens == 1:
            cache.free_sequence(seq_id)
        else:
            active.append(seq_id)
    while active:
        step_ids = torch.tensor([[last_token[s]] for s in active], device=model.device)
        logits = model(step_ids, paged=cache.prepare(active, 1), last_only=True)
        still_active = []
        for seq_id, token in zip(active, logits[:, -1].argmax(-1).tolist()):
            outputs[seq_id].append(token)
            last_token[seq_id] = token
            if token == eos_token_id or len(outputs[seq_id]) == max_new_tokens:
                cache.free_sequence(seq_id)
            else:
                still_active.append(seq_id)
        active = still_active
    return outputs
