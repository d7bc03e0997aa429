"""The fast decode path: one sequence, static buffers, one compiled step, no host sync per token.

A batch-1 decode step reads every weight once to produce one token, so its speed limit is
memory bandwidth (notebook 10's roofline). The eager engine spends its time elsewhere: a few
hundred small ops each paying Python and dispatch overhead, and one-row matrix products that
stream the weights on one core. This decoder removes both:

1. **Static buffers** (``StaticKVCache``): every step sees tensors at the same addresses and
   (nearly) the same shapes, which is what a compiler needs to reuse one compiled program.
2. **One compiled step**: ``torch.compile`` traces the model's own ``run`` (the same modules,
   no second copy of the model) for a single token and fuses each layer's norms, RoPE,
   residual adds and one-row matrix products (see ``layers.Linear``) into a few loops. On
   CUDA, ``mode="reduce-overhead"`` also records the step as a CUDA graph: one launch per
   step instead of hundreds.
3. **No host sync**: the next token is picked on the device and fed straight back in; the
   loop in ``greedy`` reads nothing back until the end. (Streaming must read each token to
   print it — that sync is the price of showing text as it comes.)

Fusing q/k/v (and gate/up) into one matrix was measured too: under ``torch.compile`` it made
no difference (the compiler already runs the three products over the same input in one
kernel), so the weights stay as the checkpoint has them.

Prefill runs eagerly through ``Transformer.forward``: a prompt is a matrix-matrix product,
which MKL/cuBLAS already run at full speed, and its length changes with every request.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Sequence

import torch

from minillm.cache.static import StaticKVCache, StaticStep
from minillm.model.llama import Transformer
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import make_generator, next_token


def can_compile(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.compile`` can build code here, and if not, why (said to the user)."""
    if device.type == "cpu" and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        return False, "no C++ compiler found (torch.compile writes C++ for the CPU); running eagerly"
    if sys.platform == "win32":
        return False, "torch.compile is not supported on Windows here; running eagerly"
    return True, ""


class FastDecoder:
    """Batch-1 generation on a ``StaticKVCache`` with a compiled decode step.

    Args:
        model: the loaded ``Transformer``.
        max_len: the most tokens (prompt + generated) one generation may hold.
        compile: compile the decode step (default: when this machine can; see ``can_compile``).
        window: the attention window grows in steps of this many tokens (see ``StaticKVCache``).
    """

    def __init__(self, model: Transformer, max_len: int = 2048, compile: bool | None = None, window: int = 64) -> None:
        self.model = model
        max_len = min(max_len, model.config.max_position_embeddings)
        self.cache = StaticKVCache(model.config, max_len, model.device, model.dtype, window)
        if compile is None:
            compile, why = can_compile(model.device)
            if not compile:
                print(f"FastDecoder: {why}", file=sys.stderr)
        self.compiled = compile
        if compile:
            mode = "reduce-overhead" if model.device.type == "cuda" else None  # CUDA graphs on a GPU
            self._decode = torch.compile(self._decode_step, fullgraph=True, mode=mode)
        else:
            self._decode = self._decode_step

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def _decode_step(self, token: torch.Tensor, write_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] after feeding ``token`` [1, 1]: the function that gets compiled."""
        step = StaticStep(self.cache, write_positions, key_positions)
        logits = self.model.run(token, step.positions(1), step.mask(None, 1), step, last_only=True)
        return logits[:, -1]

    def prefill(self, input_ids: Sequence[int]) -> torch.Tensor:
        """Run the prompt (eagerly, with every input check) into the cache; logits [1, vocab]."""
        self._check_length(len(input_ids), 0)
        ids = torch.tensor([list(input_ids)], device=self.model.device)
        with torch.inference_mode():
            return self.model(ids, cache=self.cache.at(0, len(input_ids)), last_only=True)[:, -1]

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [1, vocab] for the token [1, 1] at ``position`` (the tokens before it are cached)."""
        view = self.cache.at(position, 1)
        # The window length changes every `window` tokens: let the compiler treat it as a
        # symbol instead of compiling one program per length.
        torch._dynamo.maybe_mark_dynamic(view.key_positions, 0)
        with torch.inference_mode():
            return self._decode(token, view.write_positions, view.key_positions)

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Exactly ``max_new_tokens`` greedy tokens (no EOS stop): the loop the benchmark times.

        Each step's token stays on the device and becomes the next step's input; the ids are
        read back once, at the end.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_length(len(input_ids), max_new_tokens)
        if max_new_tokens == 0:
            return []
        with torch.inference_mode():
            out = torch.empty(max_new_tokens, dtype=torch.long, device=self.model.device)
            token = self.prefill(input_ids).argmax(-1, keepdim=True)
            out[0] = token[0, 0]
            for i in range(1, max_new_tokens):
                token = self.step(token, len(input_ids) + i - 1).argmax(-1, keepdim=True)
                out[i] = token[0, 0]
            return out.tolist()

    def stream(self, input_ids: Sequence[int], params: SamplingParams, eos_token_id: int | None = None) -> Iterator[int]:
        """Yield new token ids one by one: greedy or sampled as ``params`` says, stopping after
        ``max_new_tokens`` or at ``eos_token_id`` (unless ``params.ignore_eos``).

        Stop strings and beam search belong to the ``Engine``; this is the single-sequence
        fast path.
        """
        if params.num_beams != 1 or params.n != 1:
            raise ValueError("FastDecoder.stream decodes one sequence: num_beams and n must be 1 (use Engine)")
        self._check_length(len(input_ids), params.max_new_tokens)
        if params.max_new_tokens == 0:
            return
        device = self.model.device
        generator = make_generator(params.seed, device)
        history = torch.empty(1, len(input_ids) + params.max_new_tokens, dtype=torch.long, device=device)
        history[0, : len(input_ids)] = torch.tensor(list(input_ids), device=device)
        length = len(input_ids)
        logits = self.prefill(input_ids)
        for i in range(params.max_new_tokens):
            with torch.inference_mode():
                token = next_token(logits, history[:, :length], params, generator)
            history[0, length] = token[0]
            length += 1
            token_id = int(token[0])  # the one host sync per token: the caller wants to see it
            yield token_id
            if token_id == eos_token_id and not params.ignore_eos:
                return
            if i + 1 < params.max_new_tokens:
                logits = self.step(token[:, None], length - 1)

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt needs at least one token")
        # The last generated token is returned, never fed back: it needs no cache slot.
        needed = prompt_len + max(max_new_tokens - 1, 0)
        if needed > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs {needed} cache "
                f"slots; this FastDecoder holds {self.max_len} (raise max_len)"
            )
