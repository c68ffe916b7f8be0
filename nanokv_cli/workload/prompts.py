"""Prompt files: plain text, JSONL, ShareGPT JSON and Mooncake request traces.

Every reader yields ``PromptRequest`` objects and reports a bad input as ``PromptFileError``
naming the file and the line (or array entry) at fault, so the CLI can print one sentence.
Inputs are read defensively: only regular files (a FIFO or /dev/zero never ends), lines of at
most ``MAX_LINE_CHARS``, JSON however deeply nested, text that is valid Unicode.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from ..engine.core.cache_numbers import below_block, lookup_record
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import TOKEN_ID_RANGE
from ..paths import kind_of

FORMATS = ("auto", "text", "jsonl", "sharegpt", "mooncake")
SAMPLING_FIELDS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "ignore_eos")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
SHAREGPT_ROLES |= {"system": "system", "chatgpt": "assistant", "bard": "assistant"}
# The longest line read (and prompt taken from stdin): far beyond any model's context, and a
# bound on what one line can cost before the prompt's own length is checked against the model.
MAX_LINE_CHARS = 1 << 26
# Bytes that are not UTF-8, as errors="surrogateescape" reads them.
UNDECODABLE = re.compile("[\udc80-\udcff]")


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and the line."""


@dataclass
class PromptRequest:
    """One request of a prompt file. Exactly one of ``prompt``, ``messages``,
    ``prompt_token_ids`` or ``token_source`` says what to feed the model."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    token_source: Callable[[], list[int]] | None = None  # lazy synthesis (Mooncake)
    sampling: dict[str, Any] = field(default_factory=dict)  # per-request overrides
    timestamp: float | None = None  # arrival, seconds from the start of the trace
    num_prompt_tokens: int | None = None  # known up front for traces
    line: int = 0

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        fields = {name: getattr(defaults, name) for name in SAMPLING_FIELDS}
        fields.update(self.sampling)
        return SamplingParams(**fields)


@dataclass
class PromptFile:
    path: Path
    format: str
    requests: list[PromptRequest]

    @property
    def has_timestamps(self) -> bool:
        return any(r.timestamp is not None for r in self.requests)


def read_prompts(path: str | Path, fmt: str = "auto", limit: int | None = None) -> PromptFile:
    """Read up to ``limit`` requests from ``path`` in format ``fmt`` (``auto`` sniffs it)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise PromptFileError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if not path.exists():
        raise PromptFileError(f"{path}: no such file")
    mode = os.stat(path).st_mode
    if not path.is_file():
        raise PromptFileError(f"{path}: is {kind_of(mode)}, not a prompt file")
    readers = {
        "text": read_text,
        "jsonl": read_jsonl,
        "sharegpt": read_sharegpt,
        "mooncake": read_mooncake_trace,
    }
    try:
        fmt = detect_format(path) if fmt == "auto" else fmt
        requests = list(islice(readers[fmt](path), limit))
    except OSError as e:  # a read that fails midway (EIO, /proc/self/mem) names no file
        raise PromptFileError(f"{path}: {e.strerror or e}") from None
    if not requests:
        raise PromptFileError(f"{path}: no prompts found")
    return PromptFile(path, fmt, requests)


def detect_format(path: Path) -> str:
    """Tell the format from the file's first non-blank line (and its suffix for JSON arrays)."""
    first = _first_line(path)
    if first is None:
        raise PromptFileError(f"{path}: the file is empty")
    if first.startswith("["):
        return "sharegpt"
    if first.startswith("{"):
        try:
            obj = _json_loads(first, f"{path} line 1")
        except json.JSONDecodeError:
            if path.suffix == ".json":
                return "sharegpt"  # a pretty-printed array or object; its reader says which
            raise PromptFileError(f"{path} line 1: not valid JSON") from None
        if isinstance(obj, dict) and all(k in obj for k in ("input_length", "hash_ids")):
            return "mooncake"
        if isinstance(obj, dict) and any(k in obj for k in PROMPT_KEYS):
            return "jsonl"
        raise PromptFileError(
            f"{path}: unknown format: line 1 is a JSON object without any of the keys "
            f"{', '.join(PROMPT_KEYS)} (JSONL) or {', '.join(MOONCAKE_KEYS)} (Mooncake trace)"
        )
    if path.suffix in (".json", ".jsonl"):
        raise PromptFileError(f"{path} line 1: not valid JSON")
    return "text"


def _first_line(path: Path) -> str | None:
    # Bytes, decoded line by line: a bad byte further on is its own line's error, later.
    try:
        f = path.open("rb")
    except OSError as e:
        raise PromptFileError(f"{path}: {e.strerror}") from None
    with f:
        n = 0
        while raw := f.readline(MAX_LINE_CHARS + 1):
            n += 1
            if len(raw) > MAX_LINE_CHARS:
                raise PromptFileError(f"{path} line {n}: longer than {MAX_LINE_CHARS:,} bytes")
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise PromptFileError(
                    f"{path}: unknown format: not UTF-8 text (line {n}; expected plain text, "
                    "JSONL, ShareGPT JSON or a Mooncake trace)"
                ) from None
            if line:
                return line
    return None


def _open_text(path: Path, errors: str = "strict"):
    try:
        return path.open(encoding="utf-8", errors=errors)
    except OSError as e:
        raise PromptFileError(f"{path}: {e.strerror}") from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers."""
    # Bad bytes decode as lone surrogates (U+DC80..U+DCFF), so the error names its own line
    # (strict decoding fails on the first line of the 8 KB chunk holding the byte).
    with _open_text(path, errors="surrogateescape") as f:
        for n, line in enumerate(_bounded_lines(f, path), 1):
            if not line.isascii() and UNDECODABLE.search(line):
                raise PromptFileError(f"{path} line {n}: not UTF-8 text")
            if line.strip():
                yield n, line


def _bounded_lines(f, path: Path, max_chars: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of ``f``, refusing one longer than ``max_chars`` before it is read whole."""
    n = 0
    while line := f.readline(max_chars + 1):
        n += 1
        if len(line) > max_chars:
            raise PromptFileError(
                f"{path} line {n}: longer than {max_chars:,} characters; not a prompt file?"
            )
        yield line


def _json_loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise PromptFileError(f"{where}: JSON nested too deeply") from None


def check_text(value: str, where: str, name: str) -> str:
    """``value`` if it is valid Unicode; a lone surrogate (from a JSON escape such as
    ``"\\ud800"``) is refused here, by line, rather than by the tokenizer."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptFileError(
                f"{where}: {name} holds a lone surrogate ({value[e.start]!r}) at character "
                f"{e.start}: not valid Unicode"
            ) from None
    return value


def read_text(path: Path) -> Iterator[PromptRequest]:
    """One prompt per non-blank line; the line's trailing newline is not part of it."""
    for n, line in _lines(path):
        yield PromptRequest(prompt=line.rstrip("\r\n"), line=n)


def read_jsonl(path: Path) -> Iterator[PromptRequest]:
    for n, line in _lines(path):
        try:
            obj = _json_loads(line, f"{path} line {n}")
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        yield parse_record(obj, f"{path} line {n}", n)


def parse_record(obj: Any, where: str, line: int = 0) -> PromptRequest:
    """A ``{"prompt" | "messages" | "prompt_token_ids", sampling fields...}`` object."""
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise PromptFileError(f"{where}: expected exactly one of {', '.join(PROMPT_KEYS)}")
    req = PromptRequest(line=line, sampling=_sampling_fields(obj, where))
    key = given[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
        req.prompt = check_text(value, where, "'prompt'")
    elif key == "messages":
        req.messages = _messages(value, where)
    else:
        lo, hi = TOKEN_ID_RANGE
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and lo <= t < hi for t in value
        ):
            raise PromptFileError(
                f"{where}: 'prompt_token_ids' must be a list of token ids from {lo} to "
                f"{hi - 1:,} (what a trace records)"
            )
        req.prompt_token_ids = value
    if "timestamp" in obj:
        req.timestamp = _timestamp(obj["timestamp"], where, scale=1.0)
    return req


def _sampling_fields(obj: dict[str, Any], where: str) -> dict[str, Any]:
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    try:
        SamplingParams(**fields)  # the one check of sampling values
    except (TypeError, ValueError) as e:
        raise PromptFileError(f"{where}: {e}") from None
    return fields


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise PromptFileError(
            f'{where}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}}'
        )
    return [
        {
            "role": check_text(m["role"], where, "a role"),
            "content": check_text(m["content"], where, "a message"),
        }
        for m in value
    ]


def _timestamp(value: Any, where: str, scale: float) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not value >= 0
    ):
        # NaN never arrives and infinity never ends a run: both would hang a replay.
        raise PromptFileError(f"{where}: 'timestamp' must be a finite number >= 0")
    return value * scale


def read_sharegpt(path: Path) -> Iterator[PromptRequest]:
    """A JSON array of conversations; each becomes the chat up to its first assistant reply.

    A JSON array of JSONL-style records (``{"prompt": ...}``) is accepted too.
    """
    try:
        with _open_text(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise PromptFileError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise PromptFileError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, list):
        raise PromptFileError(
            f"{path}: unknown format: a JSON file must hold an array of ShareGPT conversations"
        )
    for i, entry in enumerate(data, 1):
        where = f"{path} entry {i}"
        if isinstance(entry, dict) and any(k in entry for k in PROMPT_KEYS):
            yield parse_record(entry, where, i)
            continue
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise PromptFileError(f"{where}: expected an object with a 'conversations' list")
        messages = _sharegpt_prompt(turns, where)
        if messages:  # conversations without a user turn have nothing to replay
            yield PromptRequest(messages=messages, line=i)


def _sharegpt_prompt(turns: list[Any], where: str) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise PromptFileError(f"{where}: each turn needs 'from' and a string 'value'")
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise PromptFileError(f"{where}: unknown speaker {turn.get('from')!r}")
        if role == "assistant":
            break
        messages.append({"role": role, "content": check_text(turn["value"], where, "a turn")})
    return messages if any(m["role"] == "user" for m in messages) else []


def read_mooncake_trace(path: Path) -> Iterator[PromptRequest]:
    """Mooncake requests: synthesized prompts, ``output_length`` tokens each (EOS ignored)."""
    from .mooncake import MalformedTraceError, read_mooncake

    try:
        for req in read_mooncake(path):
            yield PromptRequest(
                token_source=req.prompt,
                sampling={"max_tokens": max(1, req.output_length), "ignore_eos": True},
                timestamp=req.timestamp,
                num_prompt_tokens=req.input_length,
                line=req.line,
            )
    except MalformedTraceError as e:
        raise PromptFileError(f"{path} {e}") from None
    except UnicodeDecodeError:
        raise PromptFileError(f"{path}: not UTF-8 text") from None


def map_prompt_blocks(
    token_lists: list[list[int]], block_size: int, prefix_match: str = "token"
) -> dict[str, Any]:
    """How prompts would land on KV blocks, which full blocks they share, and why each missed.

    The prompts run through the engine's own BlockManager one after another, each computed
    whole and freed before the next, in a cache with room for every block (so it never
    evicts): ``hit`` marks the blocks that cache serves, and each prompt's miss reason comes
    from the same code as a model run's. Blocks are named by chained hash, so two prompts
    share a block only when everything up to and including it is equal.
    """
    from ..engine.block_manager import BlockManager
    from ..engine.core.events import CacheLookup
    from ..engine.sequence import Sequence

    lookups: list[CacheLookup] = []
    total = sum(-(-len(t) // block_size) for t in token_lists)
    bm = BlockManager(
        max(1, total),
        block_size,
        on_event=lambda e: lookups.append(e) if type(e) is CacheLookup else None,
        prefix_match=prefix_match,
    )
    first_seen: dict[int, int] = {}
    users: dict[int, set[int]] = {}
    prompts = []
    for p, tokens in enumerate(token_lists):
        seq = Sequence(tokens, block_size=block_size)
        bm.allocate(seq, bm.can_allocate(seq))
        num_hit = seq.num_cached_tokens // block_size
        seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
        bm.hash_blocks(seq)
        seq.num_cached_tokens = seq.num_tokens
        bm.deallocate(seq)
        blocks: list[dict[str, Any]] = []
        for i in range(len(tokens) // block_size):
            h = bm._block_hash(seq, i)
            first_seen.setdefault(h, p)
            users.setdefault(h, set()).add(p)
            blocks.append({"index": i, "hash": h, "num_tokens": block_size, "hit": i < num_hit})
        if len(tokens) % block_size:
            blocks.append(
                {"index": len(blocks), "hash": None, "num_tokens": len(tokens) % block_size}
            )
        prompts.append(
            {"index": p, "num_tokens": len(tokens), **lookup_record(lookups[-1]), "blocks": blocks}
        )
    for prompt in prompts:
        for block in prompt["blocks"]:
            if block["hash"] is not None:
                block["first_prompt"] = first_seen[block["hash"]]
                block["shared_by"] = len(users[block["hash"]])
    stats = bm.stats
    return {
        "block_size": block_size,
        "prompts": prompts,
        "total_blocks": sum(len(p["blocks"]) for p in prompts),
        "unique_full_blocks": len(users),
        "shared_full_blocks": sum(1 for u in users.values() if len(u) > 1),
        "prompt_tokens": stats.queries,
        "hit_tokens": stats.hits,
        "hit_rate": stats.hit_rate,
        "miss_tokens": _misses_as_rows_say(prompts, stats.miss_tokens, block_size),
    }


def _misses_as_rows_say(
    prompts: list[dict[str, Any]], miss_tokens: dict[str, int], block_size: int
) -> dict[str, int]:
    """The missed tokens by reason, in the words each prompt's row uses: a prompt too short to
    fill one block is ``below-block`` in both (the engine counts it as ``last-block``; advise
    tells the two apart the same way), so the rows add up to the headline."""
    below = 0
    for p in prompts:
        if below_block(p, block_size):
            p["miss_reason"] = "below-block"
            below += p["num_tokens"] - p["cached_tokens"]
    misses: dict[str, int] = {}
    for reason, n in miss_tokens.items():
        if reason == "last-block":
            misses[reason] = n - below
            misses["below-block"] = below
        else:
            misses[reason] = n
    return {k: v for k, v in misses.items() if v}
