"""The prompts as ``layout.py``'s detectors see them: token sequences, what each shares with an
earlier prompt, and the text helpers the findings are written with."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Prompt = str | list[dict]
Encode = Callable[[Prompt], list[int]]
Decode = Callable[[Sequence[int]], str]
Measure = Callable[[list[Prompt], int], int]
Tokens = tuple[int, ...]

# A loss under one block of the smallest size considered cannot show up in a block cache.
MIN_TOKENS = 16
# The side-by-side window: tokens decoded on each side, characters kept, the parting mark.
WINDOW_TOKENS = 32
CONTEXT_CHARS = 60
DIFF_CHARS = 80
PART_MARK = "▸"
# Prompts tried for the example pair, each costing a comparison with every earlier prompt.
EXAMPLE_TRIES = 8


@dataclass(frozen=True)
class Finding:
    """One layout cause of prefix-cache misses, its fix, and what the fix measured."""

    kind: str  # varying-first | reordered | near-duplicate | short-prefix | truncated-history
    cause: str  # one sentence, for people
    fix: str  # one sentence: what to change
    prompts: tuple[int, ...]  # the prompts the fix changes (short-prefix: the prompts it helps)
    pair: tuple[int, int]  # (a changed prompt, the earlier prompt it should have shared with)
    part_at: int  # the token where the pair's original token sequences part
    left: str  # the pair's first prompt at part_at (see the module docstring)
    right: str  # the pair's second prompt at part_at
    tokens_lost: int  # shared prompt tokens not reused because of this cause
    rewritten: list[Prompt] | None  # the whole list with the fix applied; None for a setting
    gain_tokens: int | None  # measured: cached tokens with the fix less without it
    setting: dict | None  # the setting to change, where the fix is one ({"block_size": 16})


# -- the prompts as the detectors see them --------------------------------------------------------


class _Example(NamedTuple):
    """What a detector's sentences name: prompt `i` and the earlier prompt `j` it parts from."""

    i: int
    j: int
    at: int  # where their original tokens part
    shared: int  # tokens `i` would share with an earlier prompt after the fix
    changed: tuple[int, ...]
    total: int  # prompts in the list


@dataclass
class _Layout:
    prompts: list[Prompt]
    tokens: list[Tokens]
    encode: Encode
    decode: Decode
    block_size: int
    before: list[int]  # per prompt: the longest prefix it shares with an earlier prompt
    partner: list[int]  # ... and which earlier prompt that is (-1: none)

    @classmethod
    def of(cls, prompts, encode, decode, block_size) -> _Layout:
        tokens = [tuple(encode(p)) for p in prompts]
        before, partner = _earlier_overlap(tokens)
        return cls(prompts, tokens, encode, decode, block_size, before, partner)

    def tokens_for(self, rewritten: list[Prompt]) -> list[Tokens]:
        """Token ids of a rewrite; a prompt the rewrite kept (the same object) is not encoded
        again."""
        return [
            old if new is orig else tuple(self.encode(new))
            for new, orig, old in zip(rewritten, self.prompts, self.tokens)
        ]

    def line_at(self, i: int, at: int) -> str:
        """The line of prompt `i` that holds token `at`, for naming a part in a sentence."""
        seq = self.tokens[i]
        head = self.decode(seq[max(0, at - WINDOW_TOKENS) : at]).rsplit("\n", 1)[-1]
        tail = self.decode(seq[at : at + WINDOW_TOKENS]).split("\n", 1)[0]
        return _clip((head + tail).strip(), CONTEXT_CHARS)

    def finding(
        self,
        kind: str,
        rewritten: list[Prompt],
        describe: Callable[[_Example], tuple[str, str]],
        partner_of: dict[int, int] | None = None,
    ) -> Finding | None:
        """The finding of a rewrite: the prompts it changes, the tokens it would let the list
        reuse, an example pair; None where it changes nothing, regains under MIN_TOKENS, or
        lets no prompt reuse one more whole block."""
        changed = tuple(
            i for i, (new, old) in enumerate(zip(rewritten, self.prompts)) if new is not old
        )
        if not changed:
            return None
        new_tokens = self.tokens_for(rewritten)
        after, _ = _earlier_overlap(new_tokens)
        gains = [max(0, a - b) for a, b in zip(after, self.before)]
        # Reported only where some prompt would reuse one more whole block at this block size:
        # a few tokens more shared by many prompts could add up, yet never show in a cache.
        size = self.block_size
        regained_block = any(a // size > b // size for a, b in zip(after, self.before))
        if sum(gains) < MIN_TOKENS or not regained_block:
            return None
        i, j = self._example(gains, changed, new_tokens, partner_of or {})
        at = _lcp(self.tokens[i], self.tokens[j])
        left, right = _side_by_side(self.tokens[i], self.tokens[j], at, self.decode)
        cause, fix = describe(_Example(i, j, at, after[i], changed, len(self.prompts)))
        return Finding(kind, cause, fix, changed, (i, j), at, left, right, sum(gains),
                       rewritten, None, None)  # fmt: skip

    def _example(
        self,
        gains: list[int],
        changed: tuple[int, ...],
        new_tokens: list[Tokens],
        partner_of: dict[int, int],
    ) -> tuple[int, int]:
        """The example pair: a changed prompt that regains the most (where only unchanged
        prompts regain, as when the fix changed the first prompt of a group, one of those),
        preferring, among the EXAMPLE_TRIES that regain the most, one whose partner the fix
        leaves as it is."""
        pool = [k for k in changed if gains[k]] or [k for k, g in enumerate(gains) if g]
        pool = sorted(pool, key=lambda k: (-gains[k], k))[:EXAMPLE_TRIES]
        kept = set(range(len(gains))) - set(changed)
        pairs = []
        for i in pool:
            j = partner_of.get(i)
            pairs.append((i, self._partner(i, new_tokens, set(changed)) if j is None else j))
        return next((pair for pair in pairs if pair[1] in kept), pairs[0])

    def _partner(self, i: int, new_tokens: list[Tokens], changed: set[int]) -> int:
        """The earlier prompt `i` should have shared with: one the fix brings `i` closer to.
        One the fix leaves as it is comes first, if it regains at least half the most any
        does, so the pair shows the original layout against the one that works (a ticket
        line against a prompt that starts with the policy, not two ticket lines)."""
        grew = [
            _lcp(new_tokens[i], new_tokens[k]) - _lcp(self.tokens[i], self.tokens[k])
            for k in range(i)
        ]
        most = max(grew)
        return max(range(i), key=lambda k: (k not in changed and 2 * grew[k] >= most, grew[k], k))


def _lcp(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of two token tuples (or two strings)."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:  # slices compare in C; walk item by item only inside the chunk that differs
        hi = min(lo + 256, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def _earlier_overlap(seqs: Sequence[Tokens]) -> tuple[list[int], list[int]]:
    """For each sequence, the longest prefix it shares with an earlier one, and which one.

    The earlier sequences are kept sorted; the one sharing the longest prefix with a new
    sequence is always next to where it sorts in, so each costs two comparisons.
    """
    ordered: list[tuple[Tokens, int]] = []
    shared, partner = [], []
    for i, seq in enumerate(seqs):
        at = bisect.bisect_left(ordered, (seq, i))
        best, who = 0, -1
        for k in (at - 1, at):
            if 0 <= k < len(ordered) and (n := _lcp(seq, ordered[k][0])) > best:
                best, who = n, ordered[k][1]
        shared.append(best)
        partner.append(who)
        ordered.insert(at, (seq, i))
    return shared, partner


def _visible(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _side_by_side(a: Tokens, b: Tokens, at: int, decode: Decode) -> tuple[str, str]:
    """Both prompts at token `at`: the common text before it, PART_MARK, each one's own text."""
    common = decode(a[max(0, at - WINDOW_TOKENS) : at])
    if at > WINDOW_TOKENS or len(common) > CONTEXT_CHARS:
        common = "…" + common[-CONTEXT_CHARS:]

    def own(seq: Tokens) -> str:
        if at >= len(seq):
            return "(end of prompt)"
        text = decode(seq[at : at + WINDOW_TOKENS])
        more = at + WINDOW_TOKENS < len(seq) or len(text) > DIFF_CHARS
        return _visible(text[:DIFF_CHARS]) + ("…" if more else "")

    return _visible(common) + PART_MARK + own(a), _visible(common) + PART_MARK + own(b)


def _first_text(prompt: Prompt) -> str | None:
    """A plain prompt's text, or a chat's first message's text (None: not text)."""
    if isinstance(prompt, str):
        return prompt
    content = prompt[0].get("content") if prompt else None
    return content if isinstance(content, str) else None


def _with_first_text(prompt: Prompt, text: str) -> Prompt:
    if isinstance(prompt, str):
        return text
    return [{**prompt[0], "content": text}, *prompt[1:]]


def _message_key(message: dict) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
