"""The packed-cpu backend: a decode step as one call of C++ kernels, for packed weights.

A model whose every matrix is packed (the native GGUF, or ``weights="q8_0"``...) needs no
compiler on a CPU with the vector kernels: its products and its attention are C++ already, and
what is left between them is Python — for SmolLM2, 30 layers of a dozen op calls, each paying
dispatch and allocation. So the backend hands every layer's tensors, the embedding table, the
final norm and the LM head to one C++ object once, when the engine is built
(``kernels.packed_layers``), and a decode step is one call of it: token ids to logits.

A short prefill is that step too: each prompt token is a row of its own, with its sequence's
block table and its own length (its position + 1). The step writes every row's key and value
before any row attends, so token t sees the tokens before it and itself — causal attention —
and only each prompt's last token goes through the LM head. Each row reads its own keys (flash
attention would share a key among a block of rows), so the keys read bound it as well as the
tokens (``STEP_PREFILL_TOKENS``, ``STEP_PREFILL_KEYS``); a longer prefill runs eagerly, where
each ``QuantizedLinear`` calls the same packed product on all its rows at once.

The object holds the model's tensors themselves (not copies): an engine owns its model, and
editing the model under a running engine is not supported.
"""

from __future__ import annotations

import torch

from minillm.cache.paged import PagedKVCache, PagedStep
from minillm.engine.backends.eager import EagerBackend
from minillm.model import kernels
from minillm.model.attention import Attention
from minillm.model.layers import RMSNorm, SwiGLU
from minillm.model.llama import Block, Transformer
from minillm.model.quant import QuantizedEmbedding, QuantizedLinear

# A prefill of up to this many tokens, whose rows read up to this many keys in all (row t of a
# sequence reads its position + 1), runs as the one-call step (a row per token).
STEP_PREFILL_TOKENS = 256
STEP_PREFILL_KEYS = 131_072


def _hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one inside it has forward hooks, which a C++ kernel would not call."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def layer_matrices(block: Block) -> tuple[torch.nn.Module, ...]:
    """A layer's seven matrices, in the order the layer kernel takes them: q, k, v, o, gate, up, down."""
    attn, mlp = block.self_attn, block.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def packs_whole_layer(block: Block) -> bool:
    """Whether ``block`` is a layer the C++ step can run: the standard norms, attention and SwiGLU
    modules, float32 norms (and biases, if any), every matrix packed, and no forward hooks."""
    attn, mlp, norms = block.self_attn, block.mlp, (block.input_layernorm, block.post_attention_layernorm)
    if type(attn) is not Attention or type(mlp) is not SwiGLU or any(type(norm) is not RMSNorm for norm in norms):
        return False
    if _hooked(block):
        return False
    return (all(type(layer) is QuantizedLinear and (layer.bias is None or layer.bias.dtype == torch.float32)
                for layer in layer_matrices(block))
            and norms[0].eps == norms[1].eps and all(norm.weight.dtype == torch.float32 for norm in norms))


def packs_ends(model: Transformer) -> bool:
    """Whether a model's ends are packed too: the embedding table and the LM head in block formats
    (the table whole, without float32 columns), the final norm a float32 RMSNorm, no hooks."""
    table, norm, head = model.embed_tokens, model.norm, model.lm_head
    if any(_hooked(module) for module in (table, norm, head)):
        return False
    return (type(table) is QuantizedEmbedding and table.dtype == torch.float32 and table.table.outlier_cols is None
            and type(norm) is RMSNorm and norm.weight.dtype == torch.float32
            and type(head) is QuantizedLinear and (head.bias is None or head.bias.dtype == torch.float32))


def layer_arguments(block: Block) -> tuple:
    """What the C++ step needs of a layer: the norms' weights and eps, then the seven matrices'
    blocks, float32 columns and biases, one list each (q, k, v, o, gate, up, down)."""
    matrices = [(m.qs, m.d, m.m, m.outlier_cols, m.outlier_w, m.bias) for m in layer_matrices(block)]
    qs, d, m, cols, w_cols, bias = (list(part) for part in zip(*matrices))
    return (block.input_layernorm.weight, block.post_attention_layernorm.weight, block.input_layernorm.eps,
            qs, d, m, cols, w_cols, bias)


def ends_arguments(model: Transformer) -> tuple:
    """What ``PackedLayers.set_ends`` needs: the table's blocks, the final norm's weight and eps,
    the head's blocks, float32 columns and bias."""
    table, head = model.embed_tokens.table, model.lm_head
    return (table.qs, table.d, table.m, model.norm.weight, model.norm.eps,
            head.qs, head.d, head.m, head.outlier_cols, head.outlier_w, head.bias)


def why_not_packed(model: Transformer, cache: PagedKVCache) -> str:
    """Why the packed-cpu backend cannot run ``model`` on ``cache`` ("" when it can)."""
    if model.device.type != "cpu":
        return f"the model is on {model.device}, not the CPU"
    if not kernels.vectorized():
        return "the vector kernels (AVX-512 or AVX2) are not built here" + (
            f" ({kernels.why_unavailable()})" if kernels.why_unavailable() else "")
    if any(pool.dtype != torch.float32 for pool in cache.k + cache.v):
        return "the KV cache is not float32"
    if any(_hooked(module) for module in model.modules()):
        return "the model has forward hooks, which the C++ step would not call"
    if not all(packs_whole_layer(block) for block in model.layers) or not packs_ends(model):
        return "not every matrix is packed (float weights: load with weights='native', 'q8_0', 'q4_0' or 'q4_1')"
    return ""


class PackedCPUBackend(EagerBackend):
    name = "packed-cpu"
    compiles = False

    def __init__(self, model: Transformer, cache: PagedKVCache) -> None:
        super().__init__(model)
        attention = model.layers[0].self_attn
        self._stack = kernels.packed_layers([layer_arguments(block) for block in model.layers],
                                            attention.n_kv_heads, attention.head_dim)
        self._stack.set_ends(*ends_arguments(model))

    def decode(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        return self._step(token_ids, step.positions, step.block_tables, step.context_lens, step)

    def prefill(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Up to ``STEP_PREFILL_TOKENS`` tokens reading up to ``STEP_PREFILL_KEYS`` keys: the
        one-call step, a row per token; longer: the eager forward."""
        tokens = token_ids.shape[0]
        keys = int(step.positions.sum()) + tokens
        if tokens > STEP_PREFILL_TOKENS or keys > STEP_PREFILL_KEYS:
            return super().prefill(token_ids, step)
        assert step.q_lens is not None or tokens == step.block_tables.shape[0]
        q_lens = torch.tensor(step.q_lens or [1] * tokens)
        row_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        return self._step(token_ids, step.positions, step.block_tables[row_of_token], step.positions + 1, step,
                          logits_rows=step.logits_index)

    def _step(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, step: PagedStep, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One C++ call: the table's rows, every layer, the final norm and the head. Only the rotary
        angles come from Python (``model.rotary``, the very cos and sin every other path uses)."""
        rows = token_ids.shape[0]
        cos, sin = self.model.rotary(positions[:, None], self.model.dtype)
        return self._stack.logits(token_ids.reshape(rows), cos.reshape(rows, -1), sin.reshape(rows, -1), step.k_pools,
                                  step.v_pools, step.write_blocks, step.write_offsets, block_tables, context_lens,
                                  logits_rows)
