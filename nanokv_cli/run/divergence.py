"""Where a prompt parts from the earlier prompt it shares the most with, and the text there.

The engine says why a lookup missed (``miss_reasons.py``); this says *what* differed: the
earlier request with the longest common prefix, the token index where the two part, and a
few tokens of text on both sides. It is computed from the prompts alone, outside the engine,
by ``PrefixIndex``: every prompt added so far kept in lexicographic order as bytes (one
fixed-width big-endian unit per token, so byte order is token order and a prefix sorts before
its extensions). The earlier prompt sharing the longest prefix with a new one is then one of
its two neighbours in that order: one binary search and two comparisons per prompt.

A synthesized Mooncake prompt is indexed by its hash ids (one unit per 512-token block, 8
bytes each), not by its ~10^4 tokens: the whole trace fits in a few MB and takes well under a
second. Its divergence is still given in tokens (the block where the ids differ is compared
token by token), but it has no text: the tokens are pseudo-random stand-ins.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..workload.mooncake import MOONCAKE_BLOCK_SIZE, SynthesizedPrompt, synthesize_tokens

# Tokens of text shown on each side of a divergence.
WINDOW = 8
# A token id must fit the index's 4-byte unit.
_MAX_TOKEN = (1 << 32) - 1
NO_TEXT = "synthesized prompt (hash ids only): it has no text"

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Request ``request`` shares its first ``at`` tokens with the earlier ``earlier`` (no
    earlier prompt shares more; of several that share as much, the newer of the two next to
    it in sorted order), and differs from it at token ``at`` (or ends there)."""

    request: Any
    earlier: Any
    at: int
    length: int  # tokens of this prompt
    earlier_length: int
    # Names the shared prefix: requests that part from the same prefix at the same token
    # share a point (``group``), whichever earlier request each is compared with.
    group: int
    hash_block: int | None = None  # Mooncake: the 512-token block where the hash ids differ

    @property
    def ends_here(self) -> bool:
        """This prompt is all prefix: an earlier one is equal to it or extends it."""
        return self.at >= self.length


class PrefixIndex:
    """The prompts added so far, for the longest common prefix of the next one with any.

    ``add(request, tokens, recipe)`` returns the new prompt's ``Divergence`` against the
    earlier prompts (None for the first, or when nothing is shared), then indexes it. A prompt
    with a Mooncake recipe (a ``SynthesizedPrompt`` or its recipe list) is indexed by hash ids;
    an index holds one kind, decided by its first prompt (a prompt of the other kind is left
    out and gets None).
    """

    def __init__(self) -> None:
        self._keys: list[bytes] = []  # sorted
        self._ids: list[Any] = []  # request of each key, in the same order
        self._added: list[int] = []  # when each key was added (0, 1, ...), in the same order
        self._key_of: dict[Any, bytes] = {}
        self._length: dict[Any, int] = {}  # hash mode: input_length
        self._vocab: dict[Any, int] = {}
        self.hashed: bool | None = None  # None until the first prompt

    def __len__(self) -> int:
        return len(self._keys)

    def add(
        self, request: Any, tokens: Sequence[int] | None, recipe: Any = None
    ) -> Divergence | None:
        prompt = _synthesized(recipe if recipe is not None else tokens)
        if self.hashed is None:
            self.hashed = prompt is not None
        if self.hashed != (prompt is not None):
            if prompt is None or tokens is None:
                return None
            prompt = None  # a synthesized prompt in a token index: by its tokens
        if prompt is not None:
            key = np.asarray(prompt.hash_ids, dtype=">u8").tobytes()
            length = prompt.input_length
            self._length[request] = length
            self._vocab[request] = prompt.vocab_size
        else:
            key = _token_key(tokens)
            if key is None:
                return None
            length = len(key) // 4
        div = self._nearest(request, key, length)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._ids.insert(i, request)
        self._added.insert(i, len(self._keys) - 1)
        self._key_of[request] = key
        return div

    def _nearest(self, request: Any, key: bytes, length: int) -> Divergence | None:
        i = bisect.bisect_right(self._keys, key)
        best: tuple[int, int, int] | None = None  # (units shared, when added, position)
        for j in (i - 1, i):
            if 0 <= j < len(self._keys):
                n = _common_units(key, self._keys[j], self.unit_bytes)
                # Ties go to the newer request: the one a cache would more likely still hold.
                if best is None or (n, self._added[j]) > best[:2]:
                    best = (n, self._added[j], j)
        if best is None:
            return None
        units, _, j = best
        earlier = self._ids[j]
        if self.hashed:
            at = self._hashed_common_tokens(request, key, length, earlier, units)
            other = self._length[earlier]
            block = units if at < min(length, other) else None
        else:
            at, other, block = units, len(self._keys[j]) // 4, None
        if at == 0:
            return None
        group = xxhash.xxh64_intdigest(key[: units * self.unit_bytes], seed=at)
        return Divergence(request, earlier, at, length, other, group, block)

    @property
    def unit_bytes(self) -> int:
        return 8 if self.hashed else 4

    def _hashed_common_tokens(
        self, request: Any, key: bytes, length: int, earlier: Any, units: int
    ) -> int:
        """Tokens shared by two synthesized prompts that share ``units`` hash ids: those
        blocks, cut at the shorter prompt, plus the leading tokens the next blocks (of
        different ids) happen to have in common."""
        other = self._length[earlier]
        at = min(units * MOONCAKE_BLOCK_SIZE, length, other)
        if at < units * MOONCAKE_BLOCK_SIZE or at >= min(length, other):
            return at
        mine = _synthesized_block(key, units, self._vocab.get(request, 32000))
        theirs = _synthesized_block(self._key_of[earlier], units, self._vocab[earlier])
        n = min(length, other) - at
        return at + _common_prefix(mine[:n], theirs[:n])

    # -- what is shown -------------------------------------------------------------------------

    def tokens(self, request: Any) -> np.ndarray | None:
        """A token-indexed request's prompt (None in a hash index)."""
        key = self._key_of.get(request)
        if key is None or self.hashed:
            return None
        return np.frombuffer(key, dtype=">u4")

    def describe(self, div: Divergence, decode: Decode | None, window: int = WINDOW) -> dict:
        """``div`` as a record: who it shares with, where it parts, and the text there."""
        rec: dict[str, Any] = {
            "shared_with": div.earlier,
            "at_token": div.at,
            "prompt_ends_here": div.ends_here,
            "earlier_ends_here": div.at >= div.earlier_length,
        }
        if self.hashed:
            rec["hash_block"] = div.hash_block
            if div.hash_block is not None:
                rec["hash_ids"] = [
                    _hash_id(self._key_of[r], div.hash_block) for r in (div.request, div.earlier)
                ]
            rec["text"] = None
            rec["note"] = NO_TEXT
            return rec
        mine, theirs = self.tokens(div.request), self.tokens(div.earlier)
        at = div.at
        parts = {
            "before": mine[max(0, at - window) : at],
            "this": mine[at : at + window],
            "earlier": theirs[at : at + window],
        }
        if decode is None:
            rec["token_ids"] = {k: v.tolist() for k, v in parts.items()}
        else:
            rec["text"] = {k: decode(v.tolist()) for k, v in parts.items()}
        return rec


def marked(rec: dict[str, Any], width: int = 40) -> tuple[str, str] | None:
    """The text on both sides of a divergence as two short lines, the divergence marked ‖:
    this prompt's, then the earlier one's. None where the record has no text."""
    text = rec.get("text")
    if not text:
        ids = rec.get("token_ids")
        if not ids:
            return None
        text = {
            k: " ".join(map(str, v)) + (" " if k == "before" and v else "") for k, v in ids.items()
        }
    before = _escaped(text["before"])[-width:]
    ends = {"this": rec["prompt_ends_here"], "earlier": rec["earlier_ends_here"]}
    sides = []
    for side in ("this", "earlier"):
        after = "(ends)" if ends[side] else _escaped(text[side])[:width]
        sides.append(f"…{before}‖{after}…")
    return sides[0], sides[1]


def _escaped(s: str) -> str:
    return repr(s)[1:-1]


# -- helpers -----------------------------------------------------------------------------------


def _synthesized(source: Any) -> SynthesizedPrompt | None:
    if isinstance(source, SynthesizedPrompt):
        return source
    if isinstance(source, list) and len(source) == 4 and source[0] == "mooncake":
        try:
            return SynthesizedPrompt.from_recipe(source)
        except ValueError:
            return None
    return None


def _token_key(tokens: Sequence[int] | None) -> bytes | None:
    if tokens is None:
        return None
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() > _MAX_TOKEN)):
        return None
    return ids.astype(">u4").tobytes()


def _common_units(a: bytes, b: bytes, width: int) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    return _common_prefix(x, y) // width


def _common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    differ = x != y
    i = int(np.argmax(differ)) if differ.size else 0
    return i if differ.size and differ[i] else int(differ.size)


def _hash_id(key: bytes, block: int) -> int | None:
    at = 8 * block
    return int.from_bytes(key[at : at + 8], "big") if at + 8 <= len(key) else None


def _synthesized_block(key: bytes, block: int, vocab: int) -> np.ndarray:
    h = _hash_id(key, block)
    return np.frombuffer(synthesize_tokens([h], MOONCAKE_BLOCK_SIZE, vocab), dtype="<i8")


# -- for run records -----------------------------------------------------------------------------


def lazy_decoder(model: str | None) -> Decode | None:
    """Decodes token ids with ``model``'s tokenizer, loaded on first use; None without a
    model. A tokenizer that does not load leaves the ids undecoded (None is returned)."""
    if model is None:
        return None
    state: dict[str, Any] = {}

    def decode(ids: Sequence[int]) -> str | None:
        if "tok" not in state:
            from ..engine.model.loader import load_tokenizer

            try:
                state["tok"] = load_tokenizer(model)
            except (ValueError, OSError, MemoryError):
                state["tok"] = None
        tok = state["tok"]
        return None if tok is None else tok.decode(list(ids), skip_special_tokens=False)

    return decode


class DivergenceRecorder:
    """Follows a run's prompts as they are added (``SequenceAdded``) and gives each its
    divergence record, for ``--per-request`` lines; the shared-with field is a seq id."""

    def __init__(self, decode: Decode | None = None) -> None:
        self.index = PrefixIndex()
        self.decode = decode

    def record(self, seq_id: int, tokens: Sequence[int], recipe: Any = None) -> dict | None:
        div = self.index.add(seq_id, tokens, recipe)
        if div is None:
            return None
        rec = self.index.describe(div, self.decode)
        text = rec.get("text")
        if isinstance(text, dict) and any(v is None for v in text.values()):
            del rec["text"]  # the tokenizer did not load: ids instead
            rec.update(self.index.describe(div, None))
        return rec


def annotate_prompts(
    prompts: list[dict[str, Any]],
    token_lists: Sequence[Sequence[int]],
    recipes: Sequence[Any],
    decode: Decode | None,
) -> None:
    """Give each prompt record of ``prompts.map_prompt_blocks`` (file order) its
    ``divergence``: the earlier prompt (by index) it shares the most with, and where they part."""
    index = PrefixIndex()
    for p, tokens, recipe in zip(prompts, token_lists, recipes):
        div = index.add(p["index"], tokens, recipe)
        p["divergence"] = None if div is None else index.describe(div, decode)
