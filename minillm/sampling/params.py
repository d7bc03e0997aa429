"""``SamplingParams``: every knob of the decoding rule in one frozen, validated object.

A request carries one of these from the user to the sampler. It is *frozen* (immutable) so a
request's settings cannot change halfway through generation, and it is *validated on
construction* so a bad value fails at once, with a message naming the parameter and the value,
instead of turning into NaN probabilities a hundred tokens later: ``temperature=-1`` would
flip the distribution upside down and ``top_p=0`` would keep nothing at all.

The defaults describe plain greedy decoding: temperature 0, every filter off.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minillm.structured.constraint import ResponseFormat

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes at most 64 bits
# Temperatures below this decode greedily, as in vLLM (its _SAMPLING_EPS): logits / 1e-40
# overflow to inf and the softmax turns to NaN, while at 1e-5 any real logit gap already puts
# all the probability on the top token.
GREEDY_TEMPERATURE = 1e-5
# A repetition penalty scales a seen token's logit by 1/p or p. Real use stays near 1 (1.1-1.5);
# far outside these bounds it is no longer a penalty but an override, and at 1e-300 the scaled
# logits overflow to inf and every probability turns to NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Beam search divides a finished beam's score by length ** length_penalty: at 8192 tokens an
# exponent of 79 already overflows a float. transformers' examples use 0.6-2.
LENGTH_PENALTY_LIMIT = 16.0
# The most completions (n) and beams one set of parameters may ask for: each is an engine row
# with its own state, and the server allows the same number per request.
MAX_COMPLETIONS = 128
# Alternatives reported per token with ``logprobs`` (OpenAI's top_logprobs allows 20).
MAX_LOGPROBS = 20
# OpenAI's logit_bias range: -100 bans a token in practice, +100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def _as_int(name: str, value: Any) -> int:
    # bool is a subclass of int in Python: top_k=True is almost surely a mistake, so refuse it.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    # NaN compares False with everything, so it would slip through every range check below.
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _as_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    # JSON object keys are strings, so {"1234": -100} is the usual form: accept digit strings.
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(value):,} entries, more than {MAX_LOGIT_BIAS_ENTRIES:,}")
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        token = _as_int("logit_bias token id", key)
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        bias = _as_float(f"logit_bias[{token}]", bias)
        if abs(bias) > LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias[{token}] must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias:g}")
        out[token] = bias
    return tuple(sorted(out.items()))


def _as_stop(value: Any) -> tuple[str, ...]:
    # A single string is one stop string, not a sequence of one-character stop strings.
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise TypeError(f"stop must be a str or a list of str, got {value!r} ({type(value).__name__})")
    for s in value:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {s!r} ({type(s).__name__})")
        if not s:
            # The empty string occurs everywhere: it would stop generation before the first token.
            raise ValueError("stop strings must be non-empty, got ''")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into tokens, and when to stop.

    Args:
        max_new_tokens: the most tokens to generate (>= 0).
        temperature: divides the logits before softmax (>= 0). Below 1 sharpens the
            distribution, above 1 flattens it; 0 (or anything below 1e-5) means greedy.
        top_k: keep only the k highest logits (and ties with the k-th); 0 turns it off.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p`` (in (0, 1]; 1 turns it off).
        min_p: keep tokens whose probability is at least ``min_p`` times the top token's
            (in [0, 1]; 0 turns it off).
        repetition_penalty: > 1 discourages tokens already in the prompt or the output
            (in [0.01, 100]; 1 turns it off).
        num_beams: beam search width (1 to 128; 1 means no beam search).
        length_penalty: beam search only: a finished beam's score is divided by
            ``length ** length_penalty`` (> 0 favours longer outputs, < 0 shorter ones; at most 16
            either way).
        stop: strings that end generation when they appear in the output (a str or a list
            of str; normalised to a tuple of non-empty strings).
        seed: seeds the random generator, so the same request draws the same tokens.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks use this to
            get a fixed number of tokens).
        n: completions to generate per prompt (1 to 128); with beam search, the ``n`` best beams
            (``n <= num_beams``, as transformers' ``num_return_sequences``).
        response_format: the output must match a regex, a JSON Schema or be a JSON object: a
            ``minillm.structured.ResponseFormat`` or the OpenAI dict
            (``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``). Disallowed
            tokens are masked out before every other processor, and end-of-sequence is allowed
            only where the output so far is a whole match.
        logprobs: report each generated token's log-probability and the ``logprobs`` most likely
            alternatives (0 to 20; None: none). They are the model's own distribution, the log-softmax
            of the raw logits *before* logit_bias, the grammar and the processors (vLLM's default):
            what the model thinks of the token, whatever rule picked it.
        logit_bias: token id -> a number in [-100, 100] added to that token's logit before
            anything else (OpenAI's ``logit_bias``).
        speculative: speculative decoding for this request: None follows the engine (on when it
            was built with a proposer, ``Engine(speculative=...)``), False turns it off, True
            asks for it (with prompt lookup if the engine has no proposer). The output is the
            same either way: greedy tokens identical, sampled ones from the same distribution.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    response_format: ResponseFormat | None = None
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    speculative: bool | None = None

    def __post_init__(self) -> None:
        # Normalise first (int -> float for the float fields, list -> tuple for stop), then
        # check ranges. The dataclass is frozen, so the normalised values go in through
        # object.__setattr__, the one sanctioned back door for __post_init__. Error messages
        # quote the value as the user wrote it (-1, not -1.0).
        given = {name: getattr(self, name) for name in self.__dataclass_fields__}
        ints = {name: _as_int(name, getattr(self, name)) for name in ("max_new_tokens", "top_k", "num_beams", "n")}
        floats = {
            name: _as_float(name, getattr(self, name))
            for name in ("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty")
        }
        for name, value in {**ints, **floats, "stop": _as_stop(self.stop)}.items():
            object.__setattr__(self, name, value)
        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not 0 <= seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {seed}")
            object.__setattr__(self, "seed", seed)
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise TypeError(f"speculative must be True, False or None, got {self.speculative!r:.80} "
                            f"({type(self.speculative).__name__})")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r} ({type(self.ignore_eos).__name__})")
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        object.__setattr__(self, "logit_bias", _as_logit_bias(self.logit_bias))
        if self.logprobs is not None:
            logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {logprobs}")
            object.__setattr__(self, "logprobs", logprobs)

        low, high = REPETITION_PENALTY_RANGE
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", low <= self.repetition_penalty <= high, f"in [{low}, {high:g}]"),
            ("num_beams", 1 <= self.num_beams <= MAX_COMPLETIONS, f"in [1, {MAX_COMPLETIONS}]"),
            ("length_penalty", abs(self.length_penalty) <= LENGTH_PENALTY_LIMIT,
             f"in [-{LENGTH_PENALTY_LIMIT:g}, {LENGTH_PENALTY_LIMIT:g}]"),
            ("n", 1 <= self.n <= MAX_COMPLETIONS, f"in [1, {MAX_COMPLETIONS}]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {given[name]}")
        if self.num_beams > 1:
            sampling = {"temperature": self.temperature > 0, "top_k": self.top_k > 0, "top_p": self.top_p < 1,
                        "min_p": self.min_p > 0}
            given_for_sampling = [f"{name}={given[name]}" for name, on in sampling.items() if on]
            if given_for_sampling:
                raise ValueError(
                    f"beam search is deterministic: {', '.join(given_for_sampling)} only apply to sampling "
                    f"(num_beams=1); drop them or set num_beams=1"
                )
            if self.speculative:
                raise ValueError("speculative decoding applies to sampled and greedy decoding (num_beams=1), "
                                 "not to beam search")
            if self.response_format is not None:
                raise ValueError("response_format applies to sampled and greedy decoding (num_beams=1), not to beam search")
            if self.n > self.num_beams:
                raise ValueError(f"n={self.n} completions need at least as many beams, got num_beams={self.num_beams}")
        if self.response_format is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with response_format: the constrained output ends "
                             "with end-of-sequence once it is a whole match")

    @property
    def is_greedy(self) -> bool:
        """True when each step simply takes the most likely token (temperature 0, one beam)."""
        return self.temperature < GREEDY_TEMPERATURE and self.num_beams == 1

    @property
    def do_sample(self) -> bool:
        """True when each step draws at random from the filtered distribution."""
        return self.temperature >= GREEDY_TEMPERATURE and self.num_beams == 1
