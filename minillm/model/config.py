"""The model's shape, as one small dataclass (the numbers every other module is sized by)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from minillm.errors import FileFormatError

# Architectures with the Llama block: RMSNorm, RoPE, GQA attention, SwiGLU MLP.
# Qwen2 differs only by biases on the q/k/v projections.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (grouped-query attention):
    each K/V head serves ``n_heads // n_kv_heads`` query heads, which shrinks the KV cache by
    that factor. SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64.
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 -> hidden_size // n_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise FileFormatError(
                f"unsupported architecture {self.architecture!r} (minillm runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        if self.n_heads % self.n_kv_heads != 0:
            raise FileFormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            raise FileFormatError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise FileFormatError(f"rope scaling {self.rope_scaling} is not supported (only 'llama3')")

    @property
    def n_groups(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a transformers ``config.json`` (old style ``rope_theta`` + ``rope_scaling``, or
        transformers 5's ``rope_parameters``)."""
        architecture = hf.get("model_type", "llama")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = {**rope, "rope_type": rope_type} if rope_type != "default" else None
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"],
                head_dim=hf.get("head_dim") or 0,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                attention_bias=hf.get("attention_bias", architecture == "qwen2"),
                architecture=architecture,
            )
        except KeyError as err:
            raise FileFormatError(f"config.json lacks {err.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """A transformers-style ``config.json`` for this config."""
        arch_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        return {
            "architectures": [arch_class[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **self.extra,
        }

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> ModelConfig:
        """Read GGUF metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...)."""
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise FileFormatError(
                f"unsupported architecture {arch!r} (minillm runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def need(key: str) -> Any:
            if f"{arch}.{key}" not in fields:
                raise FileFormatError(f"GGUF metadata has no {arch}.{key!r}")
            return fields[f"{arch}.{key}"]

        n_heads = need("attention.head_count")
        hidden = need("embedding_length")
        return cls(
            vocab_size=fields.get(f"{arch}.vocab_size", vocab_size),
            hidden_size=hidden,
            n_layers=need("block_count"),
            n_heads=n_heads,
            n_kv_heads=fields.get(f"{arch}.attention.head_count_kv", n_heads),
            intermediate_size=need("feed_forward_length"),
            head_dim=fields.get(f"{arch}.attention.key_length", hidden // n_heads),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=need("context_length"),
            tie_word_embeddings=tie_word_embeddings,
            architecture=arch,
            attention_bias=arch == "qwen2",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
