"""The Llama-family decoder: embeddings, N pre-norm blocks, a final norm and the LM head.

Each block is ``x + attention(norm(x))`` then ``x + mlp(norm(x))``: the residual stream
carries the signal through all layers, and each sub-layer reads a normalized copy of it
("pre-norm"), which is what keeps deep stacks stable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minillm.cache.base import build_mask
from minillm.model.attention import Attention
from minillm.model.config import ModelConfig
from minillm.model.layers import Linear, RMSNorm, SwiGLU
from minillm.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from minillm.cache.base import KVCache
    from minillm.cache.paged import PagedStep


class Block(torch.nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU, each with a residual."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, paged: PagedStep | None = None,
                layer_idx: int | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, paged, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(torch.nn.Module):
    """A Llama-family causal language model: ``model(input_ids)`` -> logits [batch, seq, vocab].

    Parameter names follow the transformers checkpoints (``layers.0.self_attn.q_proj.weight``,
    without the leading ``model.``), so an HF state dict maps onto it one to one.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: it stays float when weights are quantized)."""
        return self.norm.weight.dtype

    def set_attention_backend(self, backend: str) -> None:
        """'sdpa' (PyTorch's fused kernel, the default) or 'explicit' (the math written out)."""
        if backend not in ("sdpa", "explicit"):
            raise ValueError(f"attention backend must be 'sdpa' or 'explicit', got {backend!r}")
        for layer in self.layers:
            layer.self_attn.use_sdpa = backend == "sdpa"

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        paged: PagedStep | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] for ``input_ids`` [batch, seq].

        ``attention_mask`` (1 = real token, 0 = padding) lets a left-padded batch give each row
        the logits it would get alone; positions then count real tokens only. With a ``cache``
        the ids are only the *new* tokens: keys and values of earlier ones come from the cache
        (and ``attention_mask``, if any, covers earlier and new tokens). With a ``paged`` step
        (``PagedKVCache.prepare``), the ids are the step's new tokens, ``[rows, 1]`` or
        ``[1, tokens]``: their positions and slots come from the step. ``last_only`` computes
        the logits of the last position only — all that generation needs.
        """
        input_ids = self._check_input_ids(input_ids)
        batch, seq = input_ids.shape
        if paged is not None:
            if cache is not None or attention_mask is not None or position_ids is not None:
                raise ValueError("a paged step brings its own positions and holds unpadded sequences: "
                                 "pass no cache, attention_mask or position_ids with it")
            if input_ids.numel() != paged.positions.numel():
                raise ValueError(f"the paged step plans {paged.positions.numel()} new tokens, got input_ids "
                                 f"{list(input_ids.shape)}")
            self._check_pool_dtype(paged.k_pools[0].dtype)
            return self.run(input_ids, paged.positions.view(batch, seq), paged=paged, last_only=last_only)
        past = cache.past_length if cache is not None else 0
        if attention_mask is not None:
            attention_mask = self._check_mask(attention_mask, batch, past + seq)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq:]
            elif cache is not None:
                position_ids = cache.positions(seq)
            else:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        else:
            position_ids = self._check_positions(position_ids, input_ids.shape)
        position_ids = position_ids.to(self.device)
        if int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(position_ids.max())} is past the context window of "
                f"{self.config.max_position_embeddings} tokens"
            )
        if cache is not None:
            mask = cache.mask(attention_mask, seq)
        else:
            mask = build_mask(attention_mask, seq, seq, input_ids.device)
        return self.run(input_ids, position_ids, mask, cache, last_only=last_only)

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        paged: PagedStep | None = None,
        last_only: bool = False,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward pass itself, with no input checks: ``forward`` validates, then calls this.

        Checking ids and positions means reading values back from the device (a host sync);
        the engine, whose inputs are correct by construction, calls ``run`` directly.
        ``logits_index`` picks the flattened token positions that need logits (each prompt's
        last token in a packed prefill): the LM head, the largest matrix, runs only on those,
        and the result is [1, len(logits_index), vocab].
        """
        cos, sin = self.rotary(position_ids, self.dtype)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, paged)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1])[logits_index][None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def _check_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int32):
            raise TypeError(
                f"input_ids must be an integer torch.Tensor [batch, seq], got {type(input_ids).__name__}"
                + (f" of dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else "")
            )
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [batch, seq] with batch >= 1 and seq >= 1, "
                             f"got {list(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"the prompt has {input_ids.shape[1]} tokens, more than the context window of "
                f"{self.config.max_position_embeddings}"
            )
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the embedding table (vocab_size {self.config.vocab_size})")
        return input_ids.to(self.device)

    def _check_mask(self, attention_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(
                f"attention_mask has shape {list(attention_mask.shape)}, expected {[batch, length]} "
                "(batch, cached + new tokens)"
            )
        if attention_mask.dtype.is_complex or ((attention_mask != 0) & (attention_mask != 1)).any():
            # 2 or 0.5 would be read as "real token" by some steps and scaled by others: refuse.
            raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (real token), got values "
                             f"{sorted(set(attention_mask.flatten().tolist()))[:6]}")
        return attention_mask.to(self.device)

    @staticmethod
    def _check_positions(position_ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape != shape:
            raise ValueError(f"position_ids must be a tensor shaped like input_ids {list(shape)}")
        if position_ids.dtype not in (torch.long, torch.int32):
            raise TypeError(f"position_ids must be integers (a position is a token index), got dtype {position_ids.dtype}")
        if int(position_ids.min()) < 0:
            raise ValueError(f"position_ids must be >= 0, got {int(position_ids.min())}")
        return position_ids

    def _check_pool_dtype(self, dtype: torch.dtype) -> None:
        if dtype != self.dtype:
            raise TypeError(f"the KV cache holds {dtype} but the model computes in {self.dtype}: "
                            "build the cache with the model's dtype")
