"""Event traces: every engine event of a run, compact and seekable, for ``nanokv inspect``.

The format (version 2: zstd-framed msgpack records behind 21-byte prefixes that index the file)
is described in ``format``. The package, by concern:

* ``format``: layout, event codes, header, reading limits, errors, token bytes.
* ``checks``: what a decoded event must hold; ``frames``: bounded zstd frames.
* ``writer``: ``TraceWriter``, the listener that records a run.
* ``records`` (the index and payloads), ``budget`` (what one view may decode), ``prompts``,
  ``steps`` (events records), ``checkpoints``, put together by ``reader``'s ``TraceReader``;
  ``jsonl_v1`` reads version 1.
* ``exporter`` (``export``: JSONL, vLLM's KV events). What is made of a trace (``explain_request``,
  ``describe_state``) is ``run/analysis.py``.

Import each name from the module that defines it (the event types from ``engine/core/events``);
a constant is read where it is used: the writer's flush and checkpoint intervals in ``writer``,
a view's budget in ``budget``.
"""
