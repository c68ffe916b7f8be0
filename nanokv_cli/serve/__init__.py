"""``nanokv serve``: the OpenAI HTTP API over one engine loop.

Threads and ownership:

* the **engine thread** (``EngineLoop``) owns the engine. It iterates ``Driver.run`` over a
  ``RequestQueue``: every client's requests are admitted as they arrive and batched
  continuously, and each step's new tokens go back to the event loop in one
  ``call_soon_threadsafe``. Nothing else touches the engine;
* the **event loop** (uvicorn, the main thread) runs the HTTP handlers. A handler validates
  the body, encodes the prompt, submits the request and waits for the engine's answer
  (admitted, or refused up front with a 400), then streams the tokens it is sent
  (server-sent events) or collects them. A task per request waits for the client to go away;
  if it does, the request is aborted in the engine, whose blocks are freed at once.

``/metrics`` reads the engine's counters from the last step snapshot (the same
``report.cache_numbers`` names every view uses), and histograms the engine thread fills.
``GET /v1/nanokv/events`` streams the block map and those counters to ``nanokv top``
(``cache_stream.py``: the engine thread only queues its events).
SIGTERM stops accepting and lets in-flight requests finish (up to ``shutdown_timeout``);
SIGINT (or a second signal) aborts them. Either way the trace and report are written.

Connections are bounded (``ServeLimits``): requests in flight (a stream counts until it ends),
open connections, and how long a client may take over its headers, its body, or idle between
requests. Bodies are refused before they are parsed when too large or too deeply nested.

The package, from the bottom up: ``limits`` (``ServeLimits``), ``protocol`` (request bodies,
validation, errors, SSE), ``json_body`` (a body read within bounds), ``metrics`` (Prometheus),
``engine_loop`` (the engine thread), ``generation`` (one request's tokens as text, stop
strings), ``serving`` (``ServerState``: from a body to a response), ``middleware`` (API key,
concurrency), ``app`` (routes: ``create_app``), ``uvicorn_server`` (uvicorn, bounded) and
``server`` (``bind_socket``, ``serve``).
"""
