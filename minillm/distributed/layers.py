"""A rank's model: a normal minillm ``Transformer`` of its shard, plus three thin wrappers that talk.

The rank's model is built from ``Shard.local_config``: its attention has the rank's query and
KV heads, its feed-forward the rank's channels, so q/k/v and gate/up are already the
column-parallel halves and attention runs on the rank's own heads, unchanged — including the
paged cache, whose pools hold only the rank's KV heads. What is left are the places where the
ranks' pieces meet, each a wrapper around an ordinary layer:

* ``RowParallel`` around o_proj and down_proj: the layer multiplies the rank's slice of the
  input by its columns of the matrix, a partial sum of the full output; one ``all_reduce``
  adds the ranks' partial sums. Two per decoder layer, nothing else in the layer talks.
* ``VocabParallelEmbedding``: the rank holds rows ``vocab.start..stop`` of the table; a token
  outside them reads a row of zeros, so the all-reduced sum is the one rank's row, exactly.
* ``VocabParallelHead``: the rank computes the logits of its vocabulary rows; an all-gather
  puts every rank's columns side by side, so each rank holds all the logits (and samples the
  same token from them, given the same seed).

The wrapped layers may be float ``Linear``s or packed ``QuantizedLinear``s alike. The
``packed-cpu`` backend's one-call C++ step would skip the collectives, so it refuses these
models (it runs only its own layer types); ``eager`` runs them.
"""

from __future__ import annotations

import torch

from minillm.distributed.group import Group
from minillm.distributed.shard import Shard
from minillm.model.config import ModelConfig
from minillm.model.layers import Linear
from minillm.model.llama import Transformer
from minillm.model.quant import QuantizedEmbedding, QuantizedLinear
from minillm.model.rope import RotaryEmbedding


class RowParallel(torch.nn.Module):
    """``all_reduce(layer(x))``: a row-parallel layer's partial products, summed over the ranks."""

    def __init__(self, layer: torch.nn.Module, group: Group) -> None:
        super().__init__()
        self.layer, self.group = layer, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.layer(x))


class VocabParallelEmbedding(torch.nn.Module):
    """Rows ``vocab`` of the embedding table; the others come from the other ranks, through a sum."""

    def __init__(self, table: torch.nn.Module, vocab: range, group: Group) -> None:
        super().__init__()
        self.table, self.vocab, self.group = table, vocab, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < len(self.vocab))
        rows = self.table(local.clamp(0, len(self.vocab) - 1))
        return self.group.all_reduce(rows * mine[..., None].to(rows.dtype))


class VocabParallelHead(torch.nn.Module):
    """The LM head's rows ``vocab``; the all-gather returns the logits over the whole vocabulary."""

    def __init__(self, layer: torch.nn.Module, sizes: list[int], group: Group) -> None:
        super().__init__()
        self.layer, self.sizes, self.group = layer, sizes, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.layer(x), self.sizes)


def build_rank_model(config: ModelConfig, shard: Shard, group: Group, state: dict[str, torch.Tensor],
                     blocks: dict[str, tuple[str, dict[str, torch.Tensor]]], device: torch.device,
                     dtype: torch.dtype, sizes: list[int]) -> Transformer:
    """The rank's ``Transformer`` from its slices: ``state`` (float tensors, transformers names
    without ``model.``) and ``blocks`` (packed matrices: module name -> (format, blocks), as
    ``quant.use_blocks`` takes them). ``sizes``: every rank's count of vocabulary rows."""
    local = shard.local_config(config)
    with torch.device("meta"):  # shapes only: the real slices replace these
        model = Transformer(local)
    floats = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()}
    model.load_state_dict({k: v for k, v in floats.items() if not k.startswith(("embed_tokens", "lm_head"))},
                          strict=False, assign=True)
    for name, (fmt, parts) in blocks.items():
        if not name.startswith(("embed_tokens", "lm_head")):
            bias = floats.get(f"{name}.bias")
            _set(model, name, QuantizedLinear(fmt, **{k: v.to(device) for k, v in parts.items()}, bias=bias))
    table, head = _vocab_layers(config, floats, blocks, device, dtype)
    model.embed_tokens = VocabParallelEmbedding(table, shard.vocab, group)
    model.lm_head = VocabParallelHead(head, sizes, group)
    for block in model.layers:
        block.self_attn.o_proj = RowParallel(block.self_attn.o_proj, group)
        block.mlp.down_proj = RowParallel(block.mlp.down_proj, group)
    with torch.device(device):
        model.rotary = RotaryEmbedding(local.head_dim, local.max_position_embeddings, local.rope_theta,
                                       local.rope_scaling)
    left = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p is not None and p.is_meta]
    if left:
        raise ValueError(f"rank {shard.rank}: no weights loaded for {', '.join(left[:3])}")
    return model.eval().requires_grad_(False)


def _vocab_layers(config: ModelConfig, floats: dict[str, torch.Tensor],
                  blocks: dict[str, tuple[str, dict[str, torch.Tensor]]], device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The rank's rows of the embedding table and of the LM head (one tensor when they are tied)."""
    layers: dict[str, torch.nn.Module] = {}
    for name in ("embed_tokens", "lm_head"):
        if name in blocks:
            fmt, parts = blocks[name]
            layers[name] = QuantizedLinear(fmt, **{k: v.to(device) for k, v in parts.items()})
        elif f"{name}.weight" in floats:
            weight = floats[f"{name}.weight"]
            with torch.device("meta"):
                layers[name] = Linear(weight.shape[1], weight.shape[0], bias=False)
            layers[name].weight = torch.nn.Parameter(weight, requires_grad=False)
    if config.tie_word_embeddings:
        layers["lm_head"] = layers["embed_tokens"]
    table = layers["embed_tokens"]
    if isinstance(table, QuantizedLinear):
        return QuantizedEmbedding(table, dtype), layers["lm_head"]
    return torch.nn.Embedding.from_pretrained(table.weight, freeze=True), layers["lm_head"]


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
