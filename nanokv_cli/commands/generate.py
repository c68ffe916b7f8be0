"""``nanokv generate``: complete prompts, streaming the text, with a live view of the cache."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack, closing
from typing import Annotated, Any

import typer

from ..engine.sampling_params import SamplingParams
from ..paths import check_model_path
from ..run.encode import PromptEncoder
from ..run.interrupt import StepInterrupt
from ..run.record import RunError
from ..workload.prompts import MAX_LINE_CHARS
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
        live_on = want_live(live, json_out)
        results, interrupted = _run_generate(llm, texts, sampling, chat, live_on, json_out)
        if json_out:
            print_json(results)
        if interrupted:  # the text and summary are out: exit as an interrupted run does
            raise KeyboardInterrupt


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
) -> tuple[list[dict[str, Any]], bool]:
    """Every prompt's result, and whether Ctrl-C cut the run short (the text so far is kept)."""
    from ..engine.core.llm_engine import RequestRejected

    encoder = PromptEncoder(
        None, chat, tokenizer=llm.tokenizer, max_prompt_tokens=llm.max_model_len
    )
    prompts = [encoder.text(text) for text in texts]
    outputs = _Outputs(llm.tokenizer, texts, prompts)
    printer = _OrderedPrinter(texts) if not live and not json_out else None
    interrupted = False
    t0 = time.perf_counter()
    with ExitStack() as stack:
        view = stack.enter_context(_live_view(llm.engine, len(texts))) if live else None
        stop = stack.enter_context(StepInterrupt())

        def on_step() -> None:
            if view is not None:
                view.tick()
            if stop.requested:  # between steps: every token of the last one was handed out
                raise KeyboardInterrupt

        stream = stack.enter_context(closing(llm.stream(prompts, defaults, on_step=on_step)))
        try:
            for i, out in stream:
                piece = outputs.add(i, out)
                if view is not None:
                    view.set_text(out.seq_id, outputs.text(i))
                if printer is not None:
                    printer.add(i, piece, out.finished)
        except RequestRejected as e:
            raise RunError(str(e)) from None
        except KeyboardInterrupt:
            interrupted = True
    elapsed = time.perf_counter() - t0
    if interrupted:
        rest = outputs.finish()
        if printer is not None:
            printer.close(rest)
    results = outputs.results()
    if live and not json_out:
        _print_texts(texts, results)
    if not json_out or interrupted:  # an interrupted run always says what it kept
        _print_generate_summary(results, elapsed, interrupted)
    return results, interrupted


class _Outputs:
    """Each prompt's text as it streams, and its result: whole once finished, else what came
    before Ctrl-C (``finish_reason`` "abort", as the engine's)."""

    def __init__(self, tokenizer, texts: list[str], prompts: list[list[int]]) -> None:
        from ..engine.model.tokenizer import IncrementalDecoder

        self.texts, self.prompts = texts, prompts
        self.decoders = [IncrementalDecoder(tokenizer) for _ in texts]
        self.pieces: list[list[str]] = [[] for _ in texts]
        self.latest: list[Any] = [None] * len(texts)
        self.seen = [0] * len(texts)  # tokens handed out (a cut step may hold more, never shown)

    def add(self, i: int, out) -> str:
        piece = "".join(self.decoders[i].add(t) for t in out.new_token_ids)
        if out.finished:
            piece += self.decoders[i].flush()
        self.pieces[i].append(piece)
        self.latest[i] = out
        self.seen[i] += len(out.new_token_ids)
        return piece

    def text(self, i: int) -> str:
        return "".join(self.pieces[i])

    def finish(self) -> list[str]:
        """After Ctrl-C: what each unfinished prompt's decoder still held (a character cut
        mid-bytes), added to its text; returned for a printer to write."""
        rest = []
        for i, out in enumerate(self.latest):
            piece = "" if out is not None and out.finished else self.decoders[i].flush()
            self.pieces[i].append(piece)
            rest.append(piece)
        return rest

    def results(self) -> list[dict[str, Any]]:
        from ..llm import output_dict

        results = []
        for i, out in enumerate(self.latest):
            text = self.text(i)
            if out is not None and out.finished:
                results.append({"prompt": self.texts[i], **output_dict(out, text)})
                continue
            r = {"prompt": self.texts[i], "text": text, "token_ids": []}
            r.update(num_prompt_tokens=len(self.prompts[i]), num_output_tokens=0)
            r.update(num_cached_tokens=0, finish_reason="abort", ttft_s=None, latency_s=None)
            if out is not None:
                partial = output_dict(out, text)
                partial["token_ids"] = partial["token_ids"][: self.seen[i]]
                partial["num_output_tokens"] = len(partial["token_ids"])
                r.update(partial, finish_reason="abort", latency_s=None)
            results.append(r)
        return results


def _live_view(engine, total: int):
    from ..views.live import live_view

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

    def close(self, held_back: list[str]) -> None:
        """After Ctrl-C: the rest of what every prompt got, in order, each line ended."""
        for i in self.queue:
            if self.open != i:
                self._header(i)
            sys.stdout.write("".join(self.pending[i]) + held_back[i] + "\n")
        self.queue.clear()
        sys.stdout.flush()

    def _header(self, i: int) -> None:
        if self.many:
            sep = "\n" if self.printed else ""
            sys.stdout.write(f"{sep}--- {self.texts[i]!r}\n")
        self.open = i
        self.printed += 1


def _print_texts(texts: list[str], results: list[dict[str, Any]]) -> None:
    for i, r in enumerate(results):
        if len(results) > 1:
            sys.stdout.write(f"{chr(10) if i else ''}--- {texts[i]!r}\n")
        sys.stdout.write(r["text"] + "\n")
    sys.stdout.flush()


def _print_generate_summary(
    results: list[dict[str, Any]], elapsed: float, interrupted: bool = False
) -> None:
    n_out = sum(r["num_output_tokens"] for r in results)
    n_prompt = sum(r["num_prompt_tokens"] for r in results)
    n_cached = sum(r["num_cached_tokens"] for r in results)
    rate = n_out / elapsed if elapsed > 0 else 0.0
    hit_rate = n_cached / n_prompt if n_prompt else 0.0
    done = sum(r["finish_reason"] != "abort" for r in results)
    cut = f" · interrupted: {done} of {len(results)} prompts finished" if interrupted else ""
    stderr_console().print(
        f"[dim]{n_out} tokens in {elapsed:.2f} s ({rate:.1f} tok/s) · prompt {n_prompt} tokens, "
        f"{n_cached} from the prefix cache (hit rate {hit_rate:.1%}){cut}[/dim]"
    )
