"""Exporting a trace's events: as a version-1 JSONL trace, or as vLLM's KV event stream."""

from __future__ import annotations

import json
from typing import IO, TYPE_CHECKING

from ..engine.core.events import event_to_dict
from ..kv_events import export_batches

if TYPE_CHECKING:
    from .reader import TraceReader

# vLLM's KV event stream in each encoding (kv_events.py): today's tagged maps, the old arrays.
KV_EVENT_FORMATS = {"vllm-kv-events": "map", "vllm-kv-events-array": "array"}
EXPORT_FORMATS = ("jsonl", *KV_EVENT_FORMATS)


def export(reader: TraceReader, fmt: str, out: IO[bytes]) -> int:
    """Write the trace's events as ``fmt``; returns the number of records written.

    ``jsonl``: a header line, then one event per line (version 1, readable by any nanokv).
    ``vllm-kv-events``: vLLM's KV event stream, one msgpack ``KVEventBatch`` per step that
    changed the prefix cache, encoded as ``serve --kv-events-config`` publishes it (one place:
    ``kv_events.py``), so a consumer of vLLM's events (a KV-aware router, a dashboard) can read
    what this run's cache did. ``vllm-kv-events-array``: the same in vLLM's older positional
    encoding.
    """
    if fmt == "jsonl":
        header = {**reader.header, "version": 1}
        out.write((json.dumps(header) + "\n").encode())
        n = 0
        for event in reader.events():
            out.write((json.dumps(event_to_dict(event), separators=(",", ":")) + "\n").encode())
            n += 1
        return n
    if fmt not in KV_EVENT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")
    start = reader.header.get("created_unix", 0.0)
    n = 0
    for payload in export_batches(reader.events(), reader.block_size, start, KV_EVENT_FORMATS[fmt]):
        out.write(payload)
        n += 1
    return n
