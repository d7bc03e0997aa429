"""Stage 3 of the pipeline: logits -> next token (notebook 09).

``SamplingParams`` says how; ``build_processors`` turns it into a chain of logits processors
(repetition penalty, temperature, top-k, top-p, min-p); ``next_token`` runs the chain and
applies the decoding rule (argmax or a seeded multinomial draw). ``sample_batch`` is the
engine's one call per step: per-row parameters, logit_bias, the grammar of a
``response_format``, and the log-probabilities a request asks for.
"""

from minillm.sampling.logprobs import TokenLogprob, token_logprobs
from minillm.sampling.params import SamplingParams
from minillm.sampling.processors import (
    LogitsProcessor,
    MinP,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    apply_processors,
    build_processors,
)
from minillm.sampling.sampler import (
    NO_TOKEN,
    SamplingState,
    filtered_distribution,
    make_generator,
    next_token,
    sample_batch,
)

__all__ = [
    "NO_TOKEN",
    "LogitsProcessor",
    "MinP",
    "RepetitionPenalty",
    "SamplingParams",
    "SamplingState",
    "Temperature",
    "TopK",
    "TokenLogprob",
    "TopP",
    "apply_processors",
    "build_processors",
    "filtered_distribution",
    "make_generator",
    "next_token",
    "sample_batch",
    "token_logprobs",
]
