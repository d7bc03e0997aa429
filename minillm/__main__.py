"""The command line: ``python -m minillm {generate,chat,serve,demo,bench}``.

Only results go to stdout (completions, JSON rows, benchmark tables); progress and
diagnostics go to stderr, so the output can be piped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# load_model's weight formats and the engine's backends (kept here so `--help` does not import torch)
WEIGHTS = ("float32", "bfloat16", "native", "q8_0", "q4_0", "q4_1")
BACKENDS = ("eager", "compiled", "packed-cpu")
BACKEND_HELP = ("how steps run: eager (the notebooks' PyTorch), compiled (torch.compile) or packed-cpu (C++ kernels, "
                "for packed weights on a CPU); default: the fastest that applies")


if TYPE_CHECKING:
    from minillm.engine import Engine
    from minillm.model import Transformer
    from minillm.sampling import SamplingParams
    from minillm.tokenizer import Tokenizer


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from minillm.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        num_beams=args.num_beams,
        stop=tuple(args.stop or ()),
        seed=args.seed,
        n=args.n,
        response_format=_response_format(args),
        logprobs=args.logprobs,
    )


MAX_SCHEMA_FILE_BYTES = 1 << 20


def _response_format(args: argparse.Namespace) -> dict | None:
    """``--regex``, ``--json-schema FILE`` or ``--json-object`` as an OpenAI response_format."""
    if args.regex is not None:
        return {"type": "regex", "regex": args.regex}
    if args.json_schema is not None:
        path = Path(args.json_schema)
        if not path.is_file():
            raise ValueError(f"--json-schema {path}: no such file")
        if path.stat().st_size > MAX_SCHEMA_FILE_BYTES:
            raise ValueError(f"--json-schema {path}: {path.stat().st_size:,} bytes, more than a schema needs "
                             f"(at most {MAX_SCHEMA_FILE_BYTES:,})")
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"--json-schema {path}: not a JSON file ({err})") from None
        return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
    if args.json_object:
        return {"type": "json_object"}
    return None


def _speculation(args: argparse.Namespace) -> dict[str, object]:
    """The Engine's speculative decoding options from ``--speculative`` and ``--num-speculative-tokens``."""
    return {"speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}


@contextlib.contextmanager
def _engine(args: argparse.Namespace, **options: object) -> Iterator[Engine | None]:
    """The model loaded and its Engine built, as ``args`` ask. With ``--tensor-parallel N`` this
    process is one rank of N (under torchrun, or the first of N it starts itself): rank 0 yields
    the Engine; any other rank follows rank 0's steps until it is done, then yields None."""
    from minillm.engine import Engine

    options |= _speculation(args)
    if args.tensor_parallel == 1:
        model, tok = _load(args)
        yield Engine(model, tok, backend=args.backend, **options)
        return
    from minillm.engine import tensor_parallel
    from minillm.model.loading import default_weights

    if args.device not in (None, "cpu"):
        raise ValueError("--tensor-parallel runs CPU ranks over gloo here: leave out --device")
    start = time.perf_counter()
    weights = args.weights or default_weights(args.model, "cpu")
    run = tensor_parallel.start(args.tensor_parallel, args.model, weights)
    if not run.leader:  # a rank torchrun started: rank 0 speaks for the run
        tensor_parallel.follow(run.group, run.model)
        run.finish()
        yield None
        return
    print(f"minillm: loaded {args.model or 'SmolLM2-135M-Instruct'} over {args.tensor_parallel} tensor-parallel ranks "
          f"({weights} weights) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    engine = Engine(run.model, run.tokenizer, backend=args.backend, tensor_parallel=run.group, **options)
    try:
        yield engine
    finally:
        engine.close()
        run.finish()


def _load(args: argparse.Namespace) -> tuple[Transformer, Tokenizer]:
    from minillm.model import load_model
    from minillm.model.loading import default_weights

    start = time.perf_counter()
    weights = args.weights or default_weights(args.model, args.device)
    model, tok = load_model(args.model, device=args.device, weights=weights)
    print(f"minillm: loaded {args.model or 'SmolLM2-135M-Instruct'} on {model.device} ({weights} "
          f"weights) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return model, tok


def generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)  # validated before the model loads
    with _engine(args, block_size=args.block_size) as engine:
        if engine is None:  # a tensor-parallel rank other than 0: it followed rank 0's steps
            return
        tok = engine.tokenizer
        if args.chat:  # the prompt is a user message: its text never parses as special tokens
            prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                          for p in args.prompt]
        else:
            prompt_ids = [tok.encode(p) for p in args.prompt]
        start = time.perf_counter()
        completions = engine.generate(prompt_ids, params)
        elapsed = time.perf_counter() - start
        stats = engine.speculation_stats
        backend = engine.backend
    originals = [p for p in args.prompt for _ in range(params.n)]
    n_tokens = sum(len(c.token_ids) for c in completions)
    speculation = (f", {stats.accepted} of {stats.proposed} drafts kept in {stats.verifications} verifications"
                   if stats.verifications else "")
    print(f"minillm: {n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s, "
          f"backend {backend}{speculation})", file=sys.stderr)
    for prompt, c in zip(originals, completions):
        if args.json:
            record = {"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            if c.logprobs is not None:
                record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                       "top": [[i, v] for i, v in lp.top]} for lp in c.logprobs]
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(c.text)


def chat(args: argparse.Namespace) -> None:
    """An interactive streaming chat: type a message, read the answer as it is generated.

    Ctrl-C during an answer stops that answer (the conversation goes on without it); Ctrl-C
    or Ctrl-D at the prompt quits. When the conversation no longer fits the context window,
    the oldest turns are dropped (and the user is told), so a long chat never ends in an error.
    """
    params = _sampling_params(args)
    with _engine(args) as engine:
        if engine is not None:  # (None: a tensor-parallel rank other than 0, done following rank 0)
            _chat_loop(engine, params)


def _chat_loop(engine: Engine, params: SamplingParams) -> None:
    model, tok = engine.model, engine.tokenizer
    messages: list[dict[str, str]] = []
    print("minillm chat — an empty line, Ctrl-D or Ctrl-C quits; Ctrl-C during an answer stops it.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        dropped = _fit_context(messages, tok, model.config.max_position_embeddings - params.max_new_tokens)
        if dropped is None:
            print("minillm: that message alone does not fit the context window; try a shorter one", file=sys.stderr)
            continue
        if dropped:
            print(f"minillm: the conversation outgrew the context window: dropped its {dropped} oldest message(s)",
                  file=sys.stderr)
        print("assistant> ", end="", flush=True)
        answer = ""
        stream = engine.stream_chat(messages, params)
        try:
            for delta in stream:
                answer += delta
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            stream.close()  # the request ends here and its KV blocks are freed
            print(" [stopped]", flush=True)
            messages.pop()  # an interrupted exchange is not part of the conversation
            continue
        print()
        messages.append({"role": "assistant", "content": answer})


def serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server (``minillm.serve``), with a chat page at ``/``. Stops on
    SIGINT (exit status 130, the shell's "interrupted") or SIGTERM (0: a requested stop), after
    draining (``minillm.serve.shutdown``)."""
    # Take the port before loading the model, so a port in use fails at once with a clear message.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as err:
        raise RuntimeError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from err
    with _engine(args, max_batch_size=args.max_batch_size, prefix_caching=not args.no_prefix_caching,
                 prefill_chunk_tokens=args.prefill_chunk_tokens or None) as engine:
        if engine is None:  # a tensor-parallel rank other than 0: it followed rank 0's steps
            return 0
        return _serve(args, engine, sock, family)


def _serve(args: argparse.Namespace, engine: Engine, sock: socket.socket, family: int) -> int:
    from minillm.serve import model_name, run_server

    name = model_name(args.model)
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"minillm: serving {name} at http://{host}:{args.port}/ (the chat page; the OpenAI API under /v1, "
          f"/metrics, /health), backend {engine.backend}. /health says 'ok' once the first step has run.",
          file=sys.stderr)
    stopped_by = run_server(engine, sock, name, shutdown_timeout=args.shutdown_timeout,
                            request_timeout=args.request_timeout, api_key=args.api_key,
                            allowed_hosts=_comma_list(args.allowed_hosts), cors_origins=_comma_list(args.cors_origin))
    if stopped_by == signal.SIGINT:
        print("minillm: interrupted", file=sys.stderr)
        return 130  # the shell's convention for "ended by SIGINT"
    return 0 if stopped_by == signal.SIGTERM else 1  # (None: the web server stopped by itself, an error)


def _comma_list(values: list[str] | None) -> list[str]:
    """A repeatable option's values, each of which may be a comma-separated list."""
    return [item.strip() for value in values or () for item in value.split(",") if item.strip()]


def _fit_context(messages: list[dict[str, str]], tok: Tokenizer, budget: int) -> int | None:
    """Make the conversation's prompt fit in ``budget`` tokens by dropping its oldest
    non-system messages; return how many were dropped. If the newest message does not fit
    even alone (with the system messages), remove just it and return None: the rest of the
    conversation stays."""
    system = [m for m in messages if m["role"] == "system"]
    if len(tok.apply_chat_template(system + messages[-1:], add_generation_prompt=True)) > budget:
        messages.pop()
        return None
    dropped = 0
    while len(tok.apply_chat_template(messages, add_generation_prompt=True)) > budget:
        oldest = next(i for i, m in enumerate(messages) if m["role"] != "system")
        del messages[oldest]
        dropped += 1
    return dropped


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _seconds(value: str) -> float:
    number = float(value)
    if not 0 <= number <= 3600:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0 to 3600, got {value}")
    return number


def _positive_seconds(value: str) -> float:
    number = _seconds(value)
    if number == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description="An LLM inference engine built from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_model_and_sampling(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--model", default=None, help="a .gguf file or HF checkpoint folder (default: SmolLM2-135M-Instruct)")
        sub.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
        sub.add_argument("--weights", default=None, choices=WEIGHTS,
                         help="how the matrices are stored (notebook 11): native (a GGUF's own Q4_1/Q8_0 blocks, "
                              "run packed: the default for such a file on a CPU, float32's quality from 5.5x fewer "
                              "bytes), float32 (the default otherwise), bfloat16, or q8_0/q4_0/q4_1 quantized at load")
        sub.add_argument("--backend", default=None, choices=BACKENDS, help=BACKEND_HELP)
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily (the default)")
        sub.add_argument("--top-k", type=int, default=0)
        sub.add_argument("--top-p", type=float, default=1.0)
        sub.add_argument("--min-p", type=float, default=0.0)
        sub.add_argument("--repetition-penalty", type=float, default=1.0)
        sub.add_argument("--num-beams", type=int, default=1)
        sub.add_argument("--seed", type=int, default=None)
        sub.add_argument("--stop", action="append", help="a stop string (not included in the output); repeatable")
        sub.add_argument("--n", type=int, default=1, help="completions per prompt, each its own output row")
        constrain = sub.add_mutually_exclusive_group()
        constrain.add_argument("--regex", default=None, metavar="PATTERN",
                               help="the output must match PATTERN in full (constrained decoding)")
        constrain.add_argument("--json-schema", default=None, metavar="FILE",
                               help="the output must be JSON valid against the JSON Schema in FILE")
        constrain.add_argument("--json-object", action="store_true", help="the output must be a JSON object")
        sub.add_argument("--logprobs", type=int, default=None, metavar="K",
                         help="generate --json: each token's log-probability and its K best alternatives (0-20)")

    def add_engine_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--tensor-parallel", type=_positive, default=1, metavar="N",
                         help="split the model over N CPU processes (notebook 15): run under torchrun "
                              "--nproc-per-node N (several machines: torchrun's --nnodes), or alone: it starts the "
                              "other N - 1 itself; each process loads only its slice of the weights")
        sub.add_argument("--speculative", default=None, metavar="prompt-lookup|draft:PATH",
                         help="speculative decoding (notebook 14): drafts copied from the prompt and the answer "
                              "(prompt-lookup), or guessed by a smaller model with the same tokenizer (draft:PATH; "
                              "draft: alone is the default model in its default weights); the output is the same")
        sub.add_argument("--num-speculative-tokens", type=_positive, default=4, metavar="K",
                         help="the most drafts verified per step (default: 4; fewer where they do not pay)")

    gen = commands.add_parser("generate", help="complete prompts with a real model")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    add_model_and_sampling(gen)
    gen.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block of the paged cache")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion, in prompt order")
    add_engine_options(gen)

    chat_parser = commands.add_parser("chat", help="an interactive streaming chat with the model")
    add_model_and_sampling(chat_parser)
    add_engine_options(chat_parser)

    serve_parser = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with a chat page",
        description="Serve the model over HTTP: POST /v1/chat/completions and /v1/completions (OpenAI's API, "
                    "streaming or not: point the openai client's base_url at http://HOST:PORT/v1), GET /v1/models, "
                    "/health, /metrics (Prometheus text) and a chat page at /. One engine thread batches every "
                    "request (continuous batching); a client that disconnects has its request aborted.")
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this "
                              "machine only; 0.0.0.0 to serve the network: then set --api-key)")
    serve_parser.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve_parser.add_argument("--model", default=None,
                              help="a .gguf file or HF checkpoint folder (default: SmolLM2-135M-Instruct)")
    serve_parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    serve_parser.add_argument("--weights", default=None, choices=WEIGHTS,
                              help="how the matrices are stored (as for generate)")
    serve_parser.add_argument("--backend", default=None, choices=BACKENDS, help=BACKEND_HELP)
    serve_parser.add_argument("--max-batch-size", type=_positive, default=16,
                              help="most requests decoded together in one step (default: 16); more wait in the queue")
    add_engine_options(serve_parser)

    commands.add_parser("demo", help="run the end-to-end demo")
    serve_parser.add_argument("--prefill-chunk-tokens", type=int, default=256,
                              help="prompt tokens computed per engine step, so a long prompt does not stall the "
                                   "other streams (chunked prefill; 0: whole prompts; default: 256)")
    serve_parser.add_argument("--no-prefix-caching", action="store_true",
                              help="compute every prompt in full instead of reusing cached blocks of a shared prefix")
    access = serve_parser.add_argument_group(
        "who may use the server", "Requests must name the server in their Host header (localhost, an IP address, "
        "the machine's name when serving the network, or --allowed-hosts: this stops DNS rebinding), POST bodies "
        "must be Content-Type: application/json, and web pages of other origins are refused unless --cors-origin "
        "names them.")
    access.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY") or None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (401 otherwise); the chat "
                             "page asks for the key, /health stays open (default: $MINILLM_API_KEY, else none)")
    access.add_argument("--allowed-hosts", action="append", metavar="NAMES",
                        help="more names the Host header may give, comma-separated; '*' accepts any")
    access.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                        help="a web page origin (http://host:port) allowed to call the API from a browser; "
                             "repeatable or comma-separated; '*' for any (default: none)")
    limits = serve_parser.add_argument_group("time limits")
    limits.add_argument("--shutdown-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                        help="on SIGINT/SIGTERM, new requests get 503 and the open ones this long to finish before "
                             "they are ended (a stream with an error event and [DONE]); default: 5")
    limits.add_argument("--request-timeout", type=_positive_seconds, default=30.0, metavar="SECONDS",
                        help="a request's headers, and then its body, must each arrive within this time; default: 30")
    bench = commands.add_parser("bench", help="benchmarks against the reference libraries")
    bench.add_argument("target", nargs="?", default="model", choices=["model", "cpu", "tokenizer", "cache", "batching", "context", "latency", "load", "quant", "scheduler", "structured", "speculative", "tp",
                                                               "serve", "gpu"])
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.add_argument("--device", default=None, help="model, serve and gpu benchmarks: device (default: cuda if available)")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--model", type=Path, default=None,
                       help="model and serve benchmarks: a .gguf file or HF checkpoint folder both libraries read (default: SmolLM2-135M-Instruct)")
    load = bench.add_argument_group("serve benchmark (a Poisson load of streaming chat clients against minillm serve "
                                    "and transformers serve, each a subprocess on loopback)")
    load.add_argument("--requests", type=_positive, default=32, help="clients per run (default: 32)")
    load.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (default: 8)")
    load.add_argument("--max-tokens", type=_positive, default=32, help="tokens generated per answer (default: 32)")
    load.add_argument("--system-tokens", type=_positive, default=256,
                      help="tokens of the shared system prompt (default: 256)")
    load.add_argument("--rounds", type=_positive, default=2, help="interleaved rounds over the servers (default: 2)")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: 0)")
    load.add_argument("--max-batch-size", type=_positive, default=32,
                      help="minillm serve's --max-batch-size; both servers get a KV cache of 1024 tokens per row "
                           "(default: 32)")
    load.add_argument("--minillm-configs", default="on,no-cache,no-chunk,off",
                      help="minillm serve configurations, comma-separated: on (prefix caching and chunked prefill, "
                           "the defaults), no-cache, no-chunk, off (default: all four)")
    load.add_argument("--transformers-modes", default="cb,generate",
                      help="transformers serve modes, comma-separated: cb (--continuous-batching), generate (one "
                           "generate() at a time); 'none' skips transformers (default: cb,generate)")
    gpu = bench.add_argument_group("gpu check (`bench gpu prepare ASSETS` here, then `bench gpu run ASSETS --out DIR` "
                                   "on a CUDA machine, carrying ASSETS: SmolLM2-135M's shapes, random weights)")
    gpu.add_argument("step", nargs="?", default="run", choices=["prepare", "run"],
                     help="prepare: copy the config and tokenizer into ASSETS; run: the check (default)")
    gpu.add_argument("assets", nargs="?", type=Path, default=Path(".gpu"),
                     help="the folder for config.json and tokenizer.json (default: .gpu)")
    gpu.add_argument("--out", type=Path, default=Path("."), help="where gpu_check.json is written (default: .)")
    gpu.add_argument("--new-tokens", type=_positive, default=128, help="tokens per decode (default: 128)")
    args = parser.parse_args(argv)

    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "chat":
            chat(args)
        elif args.command == "serve":
            return serve(args)
        elif args.command == "demo":
            from minillm.demo import demo

            demo()
        elif args.command == "bench":
            from minillm import bench as benchmarks

            benchmarks.main(args)
    except (FileNotFoundError, ValueError, TypeError, MemoryError, RuntimeError) as err:
        if os.environ.get("MINILLM_DEBUG"):
            raise
        print(f"minillm: error: {err}", file=sys.stderr)  # the message names the problem; no traceback
        return 1
    except KeyboardInterrupt:
        print("minillm: interrupted", file=sys.stderr)
        return 130  # the shell's convention for "ended by SIGINT"
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, and point stdout at /dev/null so
        # Python's own flush at exit does not raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
