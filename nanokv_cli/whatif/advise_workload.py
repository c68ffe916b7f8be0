"""What ``nanokv advise`` re-runs: a prompt file's or a trace's requests as a ``Workload``,
and, for prompt text, what its layout findings (``layout.py``) need to measure a rewrite of
the prompts: the prompts as the file gives them, their encoder, and the requests of a rewrite."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..engine.sampling_params import SamplingParams
from ..run.divergence import Decode
from ..run.encode import PromptEncoder, build_requests
from ..run.loop import Request
from ..workload.mooncake import SynthesizedPrompt
from ..workload.prompts import PromptFile, PromptRequest
from .layout import Prompt

# -- the input -----------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests advise re-runs (in arrival order) and what it knows of their prompts."""

    source: str
    kind: str  # "prompts", "mooncake" (a Mooncake trace file) or "trace" (a nanokv trace)
    requests: list[Request]
    labels: list[Any]  # a request's name for people: its file line, or a trace's seq id
    decode: Decode | None = None
    texts: PromptTexts | None = None  # the prompts' text, where every prompt has text
    model: str | None = None  # whose K/V sizes the cache in GiB (None: the default model)
    recorded: dict[str, Any] | None = None  # a trace's own cache numbers
    arrivals: str = "all at once"
    notes: list[str] = field(default_factory=list)

    @property
    def hashed(self) -> bool:
        """Prompts synthesized from 512-token hash ids (a Mooncake trace)."""
        return bool(self.requests) and isinstance(
            self.requests[0].prompt_token_ids, SynthesizedPrompt
        )


@dataclass
class PromptTexts:
    """A prompt file's prompts as text (a string, or chat messages) in arrival order (the
    workload's requests'), their encoder, and ``requests(prompts)``: the workload's requests
    with those prompts instead (same sampling, arrival times and tags), for a dry run of a
    rewrite."""

    prompts: list[Prompt]
    encode: Callable[[Prompt], list[int]]
    requests: Callable[[list[Prompt]], list[Request]]


def prompt_file_workload(
    pf: PromptFile,
    encoder: PromptEncoder,
    defaults: SamplingParams,
    rate: float | None = None,
    model: str | None = None,
) -> Workload:
    """A prompt file's requests as ``replay`` builds them (same encoder, defaults, arrivals)."""
    tokens = PromptTokens(encoder)
    requests = build_requests(pf, tokens, defaults, rate)
    texts = None
    # Which request of the file each one is (requests are in arrival order, tagged by line).
    where = {r.line: i for i, r in enumerate(pf.requests)}
    if all(_text(r) is not None for r in pf.requests) and len(where) == len(requests):
        order = [where[q.tag] for q in requests]

        def rewritten(prompts: list[Prompt]) -> list[Request]:
            changed = list(pf.requests)
            for i, prompt in zip(order, prompts, strict=True):
                changed[i] = _with_text(changed[i], prompt)
            changed_file = PromptFile(pf.path, pf.format, changed)
            return build_requests(changed_file, tokens.any, defaults, rate)

        texts = PromptTexts([_text(pf.requests[i]) for i in order], tokens, rewritten)
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
        texts=texts,
        model=model,
        arrivals=arrivals,
    )


def trace_workload(path: str | Path) -> Workload:
    """A nanokv trace's requests, to run again: each prompt as recorded, its recorded number
    of output tokens (EOS ignored), its arrival time from the first one's."""
    from ..trace.reader import TraceReader

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
    from ..run.divergence import lazy_decoder

    summary = reader.summary()
    return Workload(
        source=str(path),
        kind="trace",
        requests=requests,
        labels=[r.tag for r in requests],
        decode=lazy_decoder(model),
        model=model,
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
    from ..trace.format import MAGIC, TRACE_FORMAT

    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(MAGIC):
        return True
    return head.startswith(b"{") and f'"format": "{TRACE_FORMAT}"'.encode() in head


# -- prompt text -------------------------------------------------------------------------------


def _text(r: PromptRequest) -> Prompt | None:
    return r.prompt if r.prompt is not None else r.messages


def _with_text(r: PromptRequest, prompt: Prompt) -> PromptRequest:
    if isinstance(prompt, str):
        return replace(r, prompt=prompt, messages=None)
    return replace(r, prompt=None, messages=prompt)


class PromptTokens:
    """Token ids of prompt text, each text encoded once: the layout findings encode every
    prompt again, and each rewrite keeps most prompts as they are.

    ``request`` is ``build_requests``' encoder for the file as given: its texts are checked
    against the run's longest prompt, as replay checks them. A rewrite's texts (``any``, or
    calling this) are not: the engine rejects one too long, as a run of that file would, where
    refusing it here would end the whole advice."""

    def __init__(self, encoder: PromptEncoder) -> None:
        self.encoder = encoder
        self.known: dict[tuple[bool, str], list[int]] = {}
        self.any = _Unchecked(self)
        self._unchecked: PromptEncoder | None = None

    def request(self, r: PromptRequest) -> Any:
        text = _text(r)
        if text is None:
            return self.encoder.request(r)
        key = _key(text)
        if key not in self.known:
            self.known[key] = self.encoder.request(r)
        return self.known[key]

    def __call__(self, prompt: Prompt) -> list[int]:
        key = _key(prompt)
        if key not in self.known:
            if self._unchecked is None:
                e = self.encoder
                self._unchecked = PromptEncoder(e.model, e.chat, tokenizer=e.tokenizer)
            encode = self._unchecked.text if isinstance(prompt, str) else self._unchecked.messages
            self.known[key] = encode(prompt)
        return self.known[key]


class _Unchecked:
    """``build_requests``' encoder for a rewrite of the prompts (``PromptTokens``)."""

    def __init__(self, tokens: PromptTokens) -> None:
        self.tokens = tokens

    def request(self, r: PromptRequest) -> list[int]:
        return self.tokens(_text(r))


def _key(prompt: Prompt) -> tuple[bool, str]:
    if isinstance(prompt, str):
        return False, prompt
    return True, json.dumps(prompt, sort_keys=True, ensure_ascii=False)
