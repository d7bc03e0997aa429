"""The contiguous KV cache and the memory formula: the cache refuses to overflow, the bytes per
token match the tensors the caches allocate, and the parameter count matches transformers' models
(the paged cache: ``tests/08_paged_kv_cache/test_cache.py``)."""

from __future__ import annotations

import pytest
import torch

from minillm.cache import ContiguousKVCache, PagedKVCache, kv_bytes_per_token, memory_budget, parameter_count
from minillm.model.config import ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=32,
                   max_position_embeddings=512)


def test_contiguous_cache_refuses_to_overflow():
    cache = ContiguousKVCache(TINY, 1, 4)
    cache.advance(3)
    with pytest.raises(ValueError, match="holds 4 tokens per row; 3 are used and 2 more"):
        cache.mask(None, 2)


def test_kv_bytes_formula_matches_the_allocated_tensors():
    smollm = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         intermediate_size=1536, max_position_embeddings=8192, tie_word_embeddings=True)
    assert kv_bytes_per_token(smollm, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(smollm, torch.bfloat16) == 23040
    cache = ContiguousKVCache(smollm, batch_size=2, max_len=100)
    assert cache.nbytes == memory_budget(smollm, 2, 100).kv_cache == 2 * 100 * 46080
    paged = PagedKVCache(smollm, num_blocks=10, block_size=16)
    assert paged.nbytes == (10 + 1) * 16 * 46080  # 10 blocks to hand out + the scratch block padded rows write to


def test_parameter_count_matches_real_models():
    import transformers

    for model_type, tied in (("llama", True), ("llama", False), ("qwen2", False)):
        common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied)
        hf_config = (transformers.Qwen2Config if model_type == "qwen2" else transformers.LlamaConfig)(**common)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
        ours = ModelConfig.from_hf(hf_config.to_dict())
        assert parameter_count(ours) == sum(p.numel() for p in hf_model.parameters())
