"""An OpenAI-compatible HTTP server around one ``Engine``: ``python -m minillm serve``.

The package, in the order a request meets it:

* ``protocol``: the request bodies (pydantic, strict), OpenAI's error JSON (``ApiError``), the
  replies and their Server-Sent Events;
* ``security``: the front door: which requests get in (Host, Origin and CORS, the API key,
  Content-Type), the chat page's headers, and uvicorn's bounds on slow clients;
* ``app``: the FastAPI routes, ``create_app`` and ``run_server``;
* ``worker``: the engine thread, the one loop that owns the ``Engine``, and its messages;
* ``shutdown``: how the server stops on SIGINT/SIGTERM (drain, then end what is left);
* ``metrics``: ``GET /metrics`` in Prometheus' text format (``prometheus_client``).

The life of one request, from the socket to ``data: [DONE]``::

    HTTP POST /v1/chat/completions (asyncio: FastAPI + uvicorn, many connections at once)
      │ the front door (``security.Guard``): a foreign Host or Origin, a missing API key or
      │ a body that is not JSON is refused before the body is read
      │ read the body (at most 8 MiB), count its lists, parse and validate it: a bad field is
      │ a 400 with OpenAI's error JSON, an unknown model a 404, and nothing reaches the engine
      │ apply the chat template and tokenize (in a worker thread: a long prompt must not
      │ stall the other connections); a prompt past the context window is a 400
      ▼
    a Job (its prompts and SamplingParams, one engine request per choice: n > 1 is n
      │ requests) goes on a thread-safe queue of commands: the only door into the engine
      ▼
    the engine thread (one, owning the Engine: nothing else touches it; the main thread under
      │ ``python -m minillm serve``, see ``run_server``)
      │ between two steps it runs the queued commands: add_request() for each choice, or
      │ abort() for a job whose client left; the first event back is Accepted or Failed,
      │ so a request the engine refuses is still a plain 400
      │ step(): admit and prefill what fits, decode one token for every running request,
      │ retire what finished and free its KV blocks (continuous batching)
      │ each new piece of text goes back to its job's asyncio.Queue through
      │ loop.call_soon_threadsafe (asyncio objects are not thread-safe: the event loop
      │ itself must run the put)
      ▼
    the HTTP handler, awaiting that queue: with ``stream`` it writes each piece as a
      Server-Sent Event (``data: {chunk}``), then the finish reasons, then ``data: [DONE]``;
      without, it collects the text and answers one JSON object with ``usage``.

**Disconnects.** When a streaming client goes away, Starlette cancels the response; on its
way out it queues ``abort`` for the job, so the engine thread aborts its requests before the
next step and their KV blocks are back in the pool. A non-streaming request has a task that
waits for its client's disconnect and then does the same. Either way the other requests in
the batch never notice.

``GET /metrics`` shows the engine as Prometheus text (queue, batch, KV blocks, tokens/s,
time-to-first-token and time-per-output-token histograms), and ``GET /`` is a small chat page
that streams its answers from ``/v1/chat/completions``.
"""

from minillm.serve.app import create_app, model_name, run_server

__all__ = ["create_app", "model_name", "run_server"]
