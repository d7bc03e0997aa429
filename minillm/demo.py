"""``python -m minillm demo`` (``make demo``): the finished pipeline in a few seconds.

Real weights loaded and validated, a chat answer streamed at batch 1, four sampled requests
batched together, a JSON Schema constraining an answer; each with its speed, so a first run
shows the whole course's result and whether this machine runs it well.
"""

from __future__ import annotations

import time


def demo() -> None:
    """The finished pipeline: real weights, a streamed chat answer, continuous batching, tokens/s."""
    import torch

    from minillm.engine import Engine
    from minillm.model import load_model, validate
    from minillm.model.loading import default_weights
    from minillm.sampling import SamplingParams

    start = time.perf_counter()
    weights = default_weights()  # the file's own 4-bit blocks on a CPU (notebook 11), else float32
    model, tok = load_model(weights=weights)  # the first run converts the GGUF once (a progress bar on stderr)
    where = "CUDA" if model.device.type == "cuda" else "CPU (no CUDA device found; the same code runs on a GPU)"
    print(f"SmolLM2-135M-Instruct loaded on {where}, {weights} weights, in {time.perf_counter() - start:.1f} s")
    report = validate(model, tok)
    print(f"validate(): {'all three checks ok' if report.ok else report}")

    engine = Engine(model, tok)
    print(f"backend: {engine.backend}")
    # Compile the decode step first (one row; several rows), so the speeds below are the engine's own
    # (the packed-cpu backend has nothing to compile: its step is one C++ call).
    if engine.backend == "compiled":
        print("compiling the decode step (about a minute the very first time, seconds once cached)...", flush=True)
    engine.generate(["Hello"], SamplingParams(max_new_tokens=2))
    engine.generate(["Hello", "Hi"], SamplingParams(max_new_tokens=2))
    compile_s = sum(engine.runner.compile_seconds.values())
    question = "What is the capital of France? Answer in one sentence, then name one famous museum there."
    print(f"\nuser> {question}\nassistant> ", end="", flush=True)
    messages = [{"role": "user", "content": question}]
    params = SamplingParams(max_new_tokens=64)
    start = time.perf_counter()
    stream = engine.stream_chat(messages, params)
    for piece in stream:
        print(piece, end="", flush=True)
    elapsed = time.perf_counter() - start
    assert stream.completion is not None
    n_tokens = len(stream.completion.token_ids)
    print(f"\n[{n_tokens} tokens in {elapsed:.2f} s, prefill included: {n_tokens / elapsed:.1f} tokens/s, batch 1, "
          f"backend {engine.backend}{f', compiled in {compile_s:.0f} s' if compile_s else ''}]")

    prompts = ["The three primary colors are", "def is_prime(n):", "A haiku about the sea:", "The speed of light is"]
    start = time.perf_counter()
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=0))
    elapsed = time.perf_counter() - start
    total = sum(len(c.token_ids) for c in completions)
    print(f"\ncontinuous batching, {len(prompts)} sampled requests at once "
          f"({total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s):")
    for prompt, completion in zip(prompts, completions):
        print(f"  {prompt!r} -> {completion.text.strip()[:70]!r}")

    schema = {"type": "object", "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}}}
    question = "Where is the Eiffel Tower? Answer as JSON."
    answer = engine.chat([{"role": "user", "content": question}], SamplingParams(
        max_new_tokens=40, response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    print("\nstructured output (a JSON Schema constrains every token, notebook 13):\n"
          f"  {question!r} -> {answer.text}")
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads. Next: `make test`, `make lab`, "
          "`python -m minillm bench`.")
