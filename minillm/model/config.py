"""The model's shape, as one small dataclass (the numbers every other module is sized by)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from minillm.errors import FileFormatError

# Architectures with the Llama block: RMSNorm, RoPE, GQA attention, SwiGLU MLP.
# Qwen2 differs only by biases on the q/k/v projections.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

# Sane bounds, checked before anything is sized by the config. No real model has a dimension
# near 2**31, and keeping each size below it keeps the product of two (a weight matrix) far
# from int64 overflow. Positions are turned into float32 RoPE angles, and float32 represents
# every integer only up to 2**24: beyond that, neighbouring positions would get the same angle.
MAX_SIZE = 2**31 - 1
MAX_POSITIONS = 2**24
FLOAT32_MAX = 3.4028234663852886e38

# What a field is called in a transformers config.json, where the name differs ...
HF_NAMES = {
    "architecture": "model_type", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
}
# ... and in GGUF metadata ("{arch}" is the architecture, e.g. llama.block_count).
GGUF_NAMES = {
    "architecture": "general.architecture", "vocab_size": "{arch}.vocab_size",
    "hidden_size": "{arch}.embedding_length", "n_layers": "{arch}.block_count",
    "n_heads": "{arch}.attention.head_count", "n_kv_heads": "{arch}.attention.head_count_kv",
    "intermediate_size": "{arch}.feed_forward_length", "head_dim": "{arch}.attention.key_length",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "rope_theta": "{arch}.rope.freq_base",
    "max_position_embeddings": "{arch}.context_length",
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(FileFormatError):
    """A config value that is missing, of the wrong type or out of range.

    The message is a template naming fields as ``{field}``; ``render`` fills each with
    ``name=value``, so the same check reads ``n_heads=0`` for a config built in Python and
    ``num_attention_heads=0`` (or ``llama.attention.head_count=0``) for one read from a file.
    """

    def __init__(self, template: str, **values: Any):
        self.template, self.values = template, values
        super().__init__(self.render({}))

    def render(self, names: dict[str, str]) -> str:
        return self.template.format(**{f: f"{names.get(f, f)}={v!r:.200}" for f, v in self.values.items()})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a layer count


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: Any, low: int, high: int = MAX_SIZE) -> None:
    if not _is_int(value):
        raise ConfigError("{%s} must be an integer" % name, **{name: value})
    if not low <= value <= high:
        raise ConfigError("{%s} must be between %s and %s" % (name, f"{low:,}", f"{high:,}"), **{name: value})


def _check_llama3(scaling: dict[str, Any]) -> None:
    """Llama 3.1's RoPE scaling divides by ``low_freq_factor`` and by ``high - low``: all four keys
    must be there, finite, and ordered, or the frequencies come out inf/nan without an error."""
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ConfigError("{rope_scaling} lacks %s, which llama3 scaling needs" % ", ".join(missing),
                          rope_scaling=scaling)
    if not all(_is_number(scaling[key]) for key in LLAMA3_KEYS):
        raise ConfigError("{rope_scaling}: %s must be finite numbers" % ", ".join(LLAMA3_KEYS), rope_scaling=scaling)
    if not (scaling["factor"] >= 1 and 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]
            and scaling["original_max_position_embeddings"] >= 1):
        raise ConfigError("{rope_scaling} needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                          "original_max_position_embeddings >= 1", rope_scaling=scaling)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (grouped-query attention):
    each K/V head serves ``n_heads // n_kv_heads`` query heads, which shrinks the KV cache by
    that factor. SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64.

    Every value is checked on construction (types, ranges, divisibility), so a config that
    exists is one the model can be built from; the errors are ``ConfigError``s.
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
            raise ConfigError("unsupported architecture {architecture} (minillm runs: %s)"
                              % ", ".join(SUPPORTED_ARCHITECTURES), architecture=self.architecture)
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            _check_int(name, getattr(self, name), low=1)
        _check_int("head_dim", self.head_dim, low=0)
        _check_int("max_position_embeddings", self.max_position_embeddings, low=1, high=MAX_POSITIONS)
        if not (_is_number(self.rms_norm_eps) and 0 <= self.rms_norm_eps < 1):  # a guard against 0 / 0, ~1e-6
            raise ConfigError("{rms_norm_eps} must be a number >= 0 and < 1", rms_norm_eps=self.rms_norm_eps)
        if not (_is_number(self.rope_theta) and 1 <= self.rope_theta <= FLOAT32_MAX):
            # the RoPE base: below 1 the frequencies exceed a radian per position (and overflow for
            # tiny bases); above float32's range they all become 0 and positions are ignored
            raise ConfigError("{rope_theta} must be a number from 1 to 3.4e38 (the RoPE base)",
                              rope_theta=self.rope_theta)
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError("{%s} must be true or false" % name, **{name: getattr(self, name)})
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise ConfigError("{hidden_size} is not divisible by {n_heads}: head_dim would not be a whole number",
                                  hidden_size=self.hidden_size, n_heads=self.n_heads)
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        if self.n_heads * self.head_dim > MAX_SIZE:  # the rows of q_proj
            raise ConfigError("{n_heads} x {head_dim} is more than %s query rows" % f"{MAX_SIZE:,}",
                              n_heads=self.n_heads, head_dim=self.head_dim)
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError("{n_heads} is not a multiple of {n_kv_heads}",
                              n_heads=self.n_heads, n_kv_heads=self.n_kv_heads)
        if self.head_dim % 2 != 0:
            raise ConfigError("{head_dim} must be even for rotary embeddings", head_dim=self.head_dim)
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default") if isinstance(self.rope_scaling, dict) else None
            if rope_type not in ("default", "llama3"):
                raise ConfigError("{rope_scaling} is not supported (only rope_type 'llama3')",
                                  rope_scaling=self.rope_scaling)
            if rope_type == "llama3":
                _check_llama3(self.rope_scaling)

    @property
    def n_groups(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, hf: Any, source: str = "config.json") -> ModelConfig:
        """Read a transformers ``config.json`` (old style ``rope_theta`` + ``rope_scaling``, or
        transformers 5's ``rope_parameters``). Errors are FileFormatErrors naming ``source`` and
        the config.json key."""
        if not isinstance(hf, dict):
            raise FileFormatError(f"{source}: must be a JSON object of settings, got a {type(hf).__name__}")
        rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rope = hf.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise FileFormatError(f"{source}: {rope_key} must be an object, got {rope!r:.100}")
        rope = dict(rope)
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # SwiGLU's gate; another activation runs but is wrong
            raise FileFormatError(
                f"{source}: hidden_act={hf['hidden_act']!r:.100} is not supported (Llama-family MLPs use 'silu')"
            )
        missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size") if key not in hf]
        if missing:
            raise FileFormatError(f"{source}: lacks {', '.join(map(repr, missing))}")
        architecture = hf.get("model_type", "llama")
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
                rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                attention_bias=hf.get("attention_bias", architecture == "qwen2"),
                architecture=architecture,
            )
        except ConfigError as err:
            raise FileFormatError(f"{source}: {err.render({**HF_NAMES, 'rope_scaling': rope_key})}") from None

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
    def from_gguf(cls, fields: dict[str, Any], vocab_size: int, tie_word_embeddings: bool,
                  source: str = "GGUF metadata") -> ModelConfig:
        """Read GGUF metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...).
        Errors are FileFormatErrors naming ``source`` and the metadata key."""
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise FileFormatError(
                f"{source}: unsupported architecture {arch!r:.100} (minillm runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        names = {field: key.format(arch=arch) for field, key in GGUF_NAMES.items()}

        def need(field: str) -> Any:
            if names[field] not in fields:
                raise FileFormatError(f"{source}: GGUF metadata has no {names[field]!r}")
            return fields[names[field]]

        scaling = fields.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":  # llama.cpp keeps Llama 3.1's scaling in a rope_freqs tensor: not read here
            raise FileFormatError(f"{source}: {arch}.rope.scaling.type={scaling!r:.100} is not supported")
        n_heads = need("n_heads")
        try:
            config = cls(
                vocab_size=fields.get(names["vocab_size"], vocab_size),
                hidden_size=need("hidden_size"),
                n_layers=need("n_layers"),
                n_heads=n_heads,
                n_kv_heads=fields.get(names["n_kv_heads"], n_heads),
                intermediate_size=need("intermediate_size"),
                head_dim=fields.get(names["head_dim"], 0),
                rms_norm_eps=need("rms_norm_eps"),
                rope_theta=fields.get(names["rope_theta"], 10000.0),
                max_position_embeddings=need("max_position_embeddings"),
                tie_word_embeddings=tie_word_embeddings,
                architecture=arch,
                attention_bias=arch == "qwen2",
            )
        except ConfigError as err:
            raise FileFormatError(f"{source}: {err.render(names)}") from None
        rope_dims = fields.get(f"{arch}.rope.dimension_count", config.head_dim)
        if rope_dims != config.head_dim:  # partial rotary embeddings (only some dimensions turn)
            raise FileFormatError(
                f"{source}: {arch}.rope.dimension_count={rope_dims!r:.100} differs from the head size "
                f"{config.head_dim}; only full rotary embeddings are supported"
            )
        return config

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
