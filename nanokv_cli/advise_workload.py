"""What ``nanokv advise`` re-runs: a prompt file's or a trace's requests as a ``Workload``,
and the prompt layout it can suggest (each varying first line moved after the shared text)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .divergence import Decode
from .driver import PromptEncoder, Request, build_requests
from .engine.mooncake import SynthesizedPrompt
from .engine.sampling_params import SamplingParams
from .prompts import PromptFile, PromptRequest

# -- the input -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests advise re-runs (in arrival order) and what it knows of their prompts."""

    source: str
    kind: str  # "prompts", "mooncake" (a Mooncake trace file) or "trace" (a nanokv trace)
    requests: list[Request]
    labels: list[Any]  # a request's name for people: its file line, or a trace's seq id
    decode: Decode | None = None
    # The requests with each varying first line moved after the shared text, and how many
    # prompts that moves; None where the prompts have no text.
    relayout: Callable[[], tuple[list[Request], int]] | None = None
    recorded: dict[str, Any] | None = None  # a trace's own cache numbers
    arrivals: str = "all at once"
    notes: list[str] = field(default_factory=list)

    @property
    def hashed(self) -> bool:
        """Prompts synthesized from 512-token hash ids (a Mooncake trace)."""
        return bool(self.requests) and isinstance(
            self.requests[0].prompt_token_ids, SynthesizedPrompt
        )


def prompt_file_workload(
    pf: PromptFile,
    encoder: PromptEncoder,
    defaults: SamplingParams,
    rate: float | None = None,
) -> Workload:
    """A prompt file's requests as ``replay`` builds them (same encoder, defaults, arrivals)."""
    requests = build_requests(pf, encoder, defaults, rate)
    relayout = None
    if any(_text_of(r) is not None for r in pf.requests):

        def relayout() -> tuple[list[Request], int]:
            moved, n = move_varying_first_lines(pf.requests)
            changed = PromptFile(pf.path, pf.format, moved)
            return build_requests(changed, encoder, defaults, rate), n

    decode = None
    if encoder.loaded:

        def decode(ids: Sequence[int]) -> str:
            return encoder.tokenizer.decode(list(ids), skip_special_tokens=False)

    arrivals = "rate" if rate is not None else "timestamps" if pf.has_timestamps else "all at once"
    return Workload(
        source=str(pf.path),
        kind="mooncake" if pf.format == "mooncake" else "prompts",
        requests=requests,
        labels=[r.tag for r in requests],
        decode=decode,
        relayout=relayout,
        arrivals=arrivals,
    )


def trace_workload(path: str | Path) -> Workload:
    """A nanokv trace's requests, to run again: each prompt as recorded, its recorded number
    of output tokens (EOS ignored), its arrival time from the first one's."""
    from .trace import TraceReader

    reader = TraceReader(path)
    v1 = reader.num_requests() is None  # a format 1 trace: its prompts are in its events
    added: dict[int, tuple[int, float]] = {}
    produced: dict[int, int] = {}
    prompts: dict[int, Any] = {}
    for event in reader.events(tokens=v1):
        name = type(event).__name__
        if name == "SequenceAdded":
            added[event.seq_id] = (event.max_tokens, event.arrival_time)
            if v1:
                prompts[event.seq_id] = _prompt_of(event.prompt_token_ids, event.prompt_recipe)
        elif name == "SequenceFinished" and event.reason != "abort":
            produced[event.seq_id] = event.num_completion_tokens
    if not added:
        raise ValueError(f"{path}: the trace holds no requests")
    start = min(t for _, t in added.values())
    requests = []
    for seq_id in sorted(added, key=lambda s: (added[s][1], s)):
        max_tokens, arrival = added[seq_id]
        if seq_id not in prompts:
            tokens, recipe = reader.prompt(seq_id)
            prompts[seq_id] = _prompt_of(tokens, recipe)
        params = SamplingParams(
            temperature=0.0, max_tokens=max(1, produced.get(seq_id, max_tokens)), ignore_eos=True
        )
        requests.append(Request(prompts.pop(seq_id), params, arrival - start, tag=seq_id))
    model, _ = reader.model_path()
    from .divergence import lazy_decoder

    summary = reader.summary()
    return Workload(
        source=str(path),
        kind="trace",
        requests=requests,
        labels=[r.tag for r in requests],
        decode=lazy_decoder(model),
        recorded={
            "block_size": reader.block_size,
            "num_blocks": reader.num_blocks,
            "dry_run": bool(reader.header.get("dry_run")),
            **summary["cache"],
        },
        arrivals="as recorded",
    )


def _prompt_of(tokens: Sequence[int], recipe: Any) -> Any:
    if recipe is not None:
        return SynthesizedPrompt.from_recipe(recipe)
    return list(tokens)


def is_trace(path: str | Path) -> bool:
    """Whether ``path`` is a nanokv trace (format 2, or a format 1 JSONL one)."""
    from .trace import MAGIC, TRACE_FORMAT

    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(MAGIC):
        return True
    return head.startswith(b"{") and f'"format": "{TRACE_FORMAT}"'.encode() in head


# -- prompt layout ---------------------------------------------------------------------------------


def _text_of(r: PromptRequest) -> str | None:
    if r.prompt is not None:
        return r.prompt
    if r.messages:
        return r.messages[0]["content"]
    return None


def _split(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    first, sep, rest = text.partition("\n")
    return (first, rest) if sep and rest.strip() else None


def move_varying_first_lines(
    requests: Sequence[PromptRequest],
) -> tuple[list[PromptRequest], int]:
    """The requests with each varying first line moved to the end of its text
    (``rest + "\\n" + first``), and how many moved.

    A first line varies when no other prompt starts with it, while the line after it opens
    some other prompt (as its first or second line): the text after it is shared, so putting
    the varying line last lets the shared text be a common prefix. Chat requests: their first
    message."""
    splits = [_split(_text_of(r)) for r in requests]
    firsts = Counter(s[0] for s in splits if s)
    openings: Counter[str] = Counter()
    for r, s in zip(requests, splits):
        lines = {s[0], s[1].partition("\n")[0]} if s else {(_text_of(r) or "").partition("\n")[0]}
        openings.update(lines)
    out, moved = [], 0
    for r, s in zip(requests, splits):
        if s is None or firsts[s[0]] > 1:
            out.append(r)
            continue
        opening = s[1].partition("\n")[0]
        own = {s[0], opening}
        if openings[opening] - (opening in own) < 1:
            out.append(r)
            continue
        text = s[1] + "\n" + s[0]
        if r.prompt is not None:
            out.append(replace(r, prompt=text))
        else:
            messages = [dict(m) for m in r.messages]
            messages[0]["content"] = text
            out.append(replace(r, messages=messages))
        moved += 1
    return out, moved
