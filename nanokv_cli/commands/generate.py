"""``nanokv generate``: complete prompts, streaming the text, with a live view of the cache."""

from __future__ import annotations

import math
import sys
import time
from contextlib import ExitStack
from typing import Annotated, Any

import typer

from ..driver import EngineClock, PromptEncoder, RunError
from ..engine.sampling_params import SamplingParams
from ..paths import check_model_path
from ..prompts import MAX_LINE_CHARS
from .engine_options import EngineFlags, engine_options
from .errors import user_errors
from .models import make_llm
from .option_groups import sampling_options
from .options import ChatOpt, DebugOpt, JsonOpt, LiveOpt, ModelOpt, want_live
from .output import print_json, stderr_console, stdout_console

PromptsArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="PROMPT",
        help="Prompts to complete; `-` reads one prompt from stdin.",
        show_default=False,
    ),
]


@sampling_options("Most tokens to generate per prompt.")
@engine_options()
def generate(
    prompts: PromptsArg = None,
    model: ModelOpt = None,
    *,
    sampling: SamplingParams,
    chat: ChatOpt = False,
    engine: EngineFlags,
    live: LiveOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text, streaming it as it comes, with a live view of the KV cache.

    **Examples**

    ```
    nanokv generate "The capital of France is"
    nanokv generate --chat "Write a haiku about caches" --max-tokens 40
    echo "Once upon a time" | nanokv generate - --no-live
    nanokv generate "a" "b" --json
    ```
    """
    texts = _prompt_args(prompts)
    engine_config = engine.config()
    with user_errors(debug):
        check_model_path(model)
        llm = make_llm(model, engine_config)
        results = _run_generate(llm, texts, sampling, chat, want_live(live, json_out), json_out)
        if json_out:
            print_json(results)


def _prompt_args(prompts: list[str] | None) -> list[str]:
    if not prompts:
        raise typer.BadParameter(
            "give at least one PROMPT, or - to read one from stdin", param_hint="PROMPT"
        )
    if "-" in prompts:
        if len(prompts) > 1:
            raise typer.BadParameter(
                "- (stdin) cannot be mixed with other prompts", param_hint="PROMPT"
            )
        text = _read_stdin(MAX_LINE_CHARS)
        text = text[:-1] if text.endswith("\n") else text
        if not text.strip():
            raise typer.BadParameter("stdin held no prompt", param_hint="PROMPT")
        prompts = [text]
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # argv decodes bytes that are not UTF-8 as surrogates
            raise typer.BadParameter(
                f"prompt {i + 1} is not UTF-8 text (at character {e.start})", param_hint="PROMPT"
            ) from None
    return prompts


def _read_stdin(max_chars: int) -> str:
    """stdin up to ``max_chars`` (a prompt, not /dev/zero); more is a usage error."""
    try:
        text = sys.stdin.read(max_chars + 1)
    except UnicodeDecodeError:
        raise typer.BadParameter("stdin is not UTF-8 text", param_hint="PROMPT") from None
    if len(text) > max_chars:
        raise typer.BadParameter(
            f"stdin holds more than {max_chars:,} characters; that is no prompt",
            param_hint="PROMPT",
        )
    return text


def _run_generate(
    llm, texts: list[str], defaults: SamplingParams, chat: bool, live: bool, json_out: bool
) -> list[dict[str, Any]]:
    from ..driver import Arrivals, Driver, Request
    from ..engine.tokenizer import IncrementalDecoder

    engine, tokenizer = llm.engine, llm.tokenizer
    encoder = PromptEncoder(None, chat, tokenizer=tokenizer, max_prompt_tokens=llm.max_model_len)
    clock = EngineClock(engine)
    index: dict[int, int] = {}  # seq_id -> prompt index

    def on_rejected(req, error: Exception) -> None:
        prefix = f"prompt {req.tag + 1}: " if len(texts) > 1 else ""
        raise RunError(f"{prefix}{error}")

    driver = Driver(
        engine,
        clock,
        max_waiting=math.inf,  # every prompt is admitted (or rejected) before the first step
        on_added=lambda seq_id, req: index.__setitem__(seq_id, req.tag),
        on_rejected=on_rejected,
    )
    source = Arrivals(
        [Request(encoder.text(text), defaults, 0.0, tag=i) for i, text in enumerate(texts)],
        start=clock(),
    )
    driver.admit(source)
    decoders = [IncrementalDecoder(tokenizer) for _ in texts]
    pieces: list[list[str]] = [[] for _ in texts]
    finals: list[Any] = [None] * len(texts)
    printer = _OrderedPrinter(texts) if not live and not json_out else None
    t0 = time.perf_counter()
    with ExitStack() as stack:
        view = stack.enter_context(_live_view(engine, len(texts))) if live else None
        for outputs in driver.run(source):
            for out in outputs:
                i = index[out.seq_id]
                piece = "".join(decoders[i].add(t) for t in out.new_token_ids)
                if out.finished:
                    piece += decoders[i].flush()
                    finals[i] = out
                pieces[i].append(piece)
                if view is not None:
                    view.set_text(out.seq_id, "".join(pieces[i]))
                if printer is not None:
                    printer.add(i, piece, out.finished)
            if view is not None:
                view.tick()
    elapsed = time.perf_counter() - t0
    results = [_generate_result(texts[i], "".join(pieces[i]), finals[i]) for i in range(len(texts))]
    if live and not json_out:
        _print_texts(texts, results)
    if not json_out:
        _print_generate_summary(results, elapsed)
    return results


def _live_view(engine, total: int):
    from ..driver import live_view

    return live_view(
        engine,
        stdout_console(),
        title="nanokv generate",
        total_requests=total,
        show_text=True,
        transient=True,
    )


class _OrderedPrinter:
    """Streams outputs to stdout in prompt order: the first one live, each next one as soon
    as those before it are complete."""

    def __init__(self, texts: list[str]) -> None:
        self.queue = list(range(len(texts)))
        self.texts = texts
        self.pending: list[list[str]] = [[] for _ in texts]
        self.done: set[int] = set()
        self.many = len(texts) > 1
        self.open: int | None = None  # the prompt whose header is written
        self.printed = 0

    def add(self, i: int, piece: str, finished: bool) -> None:
        self.pending[i].append(piece)
        if finished:
            self.done.add(i)
        while self.queue:
            head = self.queue[0]
            if self.open != head:
                self._header(head)
            sys.stdout.write("".join(self.pending[head]))
            self.pending[head].clear()
            if head not in self.done:
                break
            sys.stdout.write("\n")
            self.queue.pop(0)
        sys.stdout.flush()

    def _header(self, i: int) -> None:
        if self.many:
            sep = "\n" if self.printed else ""
            sys.stdout.write(f"{sep}--- {self.texts[i]!r}\n")
        self.open = i
        self.printed += 1


def _generate_result(prompt: str, text: str, out) -> dict[str, Any]:
    ttft = out.first_token_time - out.arrival_time if out.first_token_time is not None else None
    return {
        "prompt": prompt,
        "text": text,
        "token_ids": list(out.token_ids),
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": ttft,
        "latency_s": out.finish_time - out.arrival_time if out.finish_time is not None else None,
    }


def _print_texts(texts: list[str], results: list[dict[str, Any]]) -> None:
    for i, r in enumerate(results):
        if len(results) > 1:
            sys.stdout.write(f"{chr(10) if i else ''}--- {texts[i]!r}\n")
        sys.stdout.write(r["text"] + "\n")
    sys.stdout.flush()


def _print_generate_summary(results: list[dict[str, Any]], elapsed: float) -> None:
    n_out = sum(r["num_output_tokens"] for r in results)
    n_prompt = sum(r["num_prompt_tokens"] for r in results)
    n_cached = sum(r["num_cached_tokens"] for r in results)
    rate = n_out / elapsed if elapsed > 0 else 0.0
    hit_rate = n_cached / n_prompt if n_prompt else 0.0
    stderr_console().print(
        f"[dim]{n_out} tokens in {elapsed:.2f} s ({rate:.1f} tok/s) · prompt {n_prompt} tokens, "
        f"{n_cached} from the prefix cache (hit rate {hit_rate:.1%})[/dim]"
    )
