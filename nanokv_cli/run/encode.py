"""Prompts into token ids: ``PromptEncoder`` (text and chat messages, with the model's
tokenizer and template, loaded once) and a prompt file's requests (``build_requests``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..engine.core.llm_engine import RequestRejected
from ..engine.core.requests import Request, all_at_once, at_rate
from ..engine.model.loader import load_tokenizer
from ..engine.sampling_params import SamplingParams
from ..workload.prompts import PromptFile, PromptRequest
from .record import RunError

# -- prompts -----------------------------------------------------------------------------------


# A synthesized prompt longer than this (8 bytes a token) and than the run admits is rejected
# before its tokens are made.
EAGER_REJECT_TOKENS = 1 << 20


class PromptEncoder:
    """Token ids of prompt-file requests; loads the tokenizer only if some request has text.

    ``max_prompt_tokens``, the longest prompt the run could admit, is checked before any work:
    text with more bytes than that many tokens can hold never reaches the tokenizer, and a
    long synthesized prompt over it is rejected (as the engine would) before its tokens are
    made.
    """

    def __init__(
        self, model: str | None, chat: bool, tokenizer=None, max_prompt_tokens: int | None = None
    ) -> None:
        self.model = model
        self.chat = chat
        self._tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def text(self, prompt: str) -> list[int]:
        if self.chat:
            return self.messages([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, max_tokens=self.max_prompt_tokens)

    def messages(self, messages: list[dict[str, str]]) -> list[int]:
        for m in messages:  # before the template copies them around
            self.tokenizer.check_text(m["content"], self.max_prompt_tokens)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already wrote every special token the model expects.
        return self.tokenizer.encode(
            text, add_special_tokens=False, max_tokens=self.max_prompt_tokens
        )

    def request(self, req: PromptRequest) -> list[int] | Callable[[], list[int]]:
        if req.token_source is not None:
            n, limit = req.num_prompt_tokens, self.max_prompt_tokens
            # Only where making the tokens would cost real memory: the engine's own rejection
            # of a shorter one says what to change.
            if n is not None and limit is not None and n > max(limit, EAGER_REJECT_TOKENS):
                return _Rejected(
                    f"the prompt ({n:,} tokens) is longer than the {limit:,} this run admits"
                )
            return req.token_source
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if req.messages is not None:
            return self.messages(req.messages)
        return self.text(req.prompt or "")


class _Rejected:
    """A prompt refused before its tokens were made: asking for them rejects the request."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self) -> list[int]:
        raise RequestRejected(self.reason)


def encode_prompts(pf: PromptFile, encoder: PromptEncoder) -> list:
    """Each request's token ids (or the callable that makes them), in file order; a request
    that cannot be encoded is reported by its file and line."""
    out = []
    for r in pf.requests:
        try:
            out.append(encoder.request(r))
        except ValueError as e:
            raise RunError(f"{pf.path} line {r.line}: {e}") from None
    return out


def build_requests(
    pf: PromptFile, encoder: PromptEncoder, defaults: SamplingParams, rate: float | None
) -> list[Request]:
    """Engine requests in arrival order: the file's timestamps, a Poisson ``rate``, or all at 0."""
    requests = [
        Request(tokens, r.sampling_params(defaults), r.timestamp or 0.0, tag=r.line)
        for r, tokens in zip(pf.requests, encode_prompts(pf, encoder))
    ]
    if rate is not None:
        if math.isinf(rate):
            return list(all_at_once(requests))
        timed = list(at_rate(requests, rate))
        if timed and not math.isfinite(timed[-1].arrival_time):
            # Gaps of ~1/rate seconds add up past the largest float: no arrival time is left.
            raise RunError(
                f"--rate {rate!r} is too low: the arrival times of {len(timed):,} requests "
                "overflow; give a higher rate"
            )
        return timed
    if pf.has_timestamps:
        return sorted(requests, key=lambda q: q.arrival_time)
    return list(all_at_once(requests))
