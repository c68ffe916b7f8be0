"""Prompt-layout findings: where the way prompts are written costs prefix-cache hits.

A prefix cache reuses a prompt's leading tokens only while they equal an earlier prompt's, so a
low hit rate is most often caused by *layout*, not by engine settings: a timestamp line above a
shared system prompt, the same tools listed in another order, a stray CRLF, a history that drops
its oldest turn. This module finds such causes from the prompts alone, rewrites the prompt list
with each fix applied, and has the caller measure what each fix gains.

API::

    Prompt = str | list[dict]    # plain text, or chat messages [{"role": ..., "content": str}]

    find_layout_findings(prompts, encode, decode, block_size, measure, max_findings=5)
        -> list[Finding]

``encode(prompt) -> list[int]`` is the caller's encoder (it applies the chat template to
messages), ``decode(ids) -> str`` its decoder, and ``measure(prompts, block_size) -> int`` the
prompt tokens served from cache when those prompts run in order (an engine's dry run). Measure
is called once on the original list and once per finding, on its rewrite (or, for a setting,
on the original list at that setting); ``gain_tokens`` is the difference, so a gain is measured,
never estimated. Findings are ranked by that gain, highest first; a fix that measures no gain
(<= 0) is still reported, ranked after those that gain. Gains of two findings do not add up:
each is measured alone, against the original list.

Each ``Finding`` gives the cause and the fix in one sentence each, the prompts the fix changes,
an example pair (a changed prompt and the earlier prompt it should have shared with), the token
where that pair's token sequences part (``part_at``) and both texts there (``left``, ``right``:
up to ``CONTEXT_CHARS`` of common text, ``PART_MARK``, then up to ``DIFF_CHARS`` of each side's
own text; newlines, CRs and tabs shown as ``\\n``, ``\\r``, ``\\t``), and ``tokens_lost``: the
prompt tokens the list shares but does not reuse because of this cause, i.e. over all prompts,
the longest prefix each would share with an earlier prompt after the fix less the one it shares
now (in tokens, not rounded to blocks; the measured gain is in whole blocks). A rewrite is
reported only where its loss is ``MIN_TOKENS`` (one block of the smallest size considered) or
more and, at the current block size, some prompt would reuse one more whole block with it.

Detectors (each one finding at most, covering every prompt it applies to):

* ``varying-first``: up to ``LEAD_LINES`` short lines that vary (timestamps, ids, names: a line
  found in at most half as many prompts as the line after it) at the start of a plain prompt
  or of a chat's first message, before text shared with other prompts. Fix: move them to where
  the shared text ends, in the same message (a request id in the system message stays a system
  instruction, which moving it into the last user message would not keep; and the model still
  reads it before the question). Varying text inside a line, or after some shared text, is not
  found here.
* ``reordered``: the same parts in another order: paragraphs or header-led sections of a text
  (tools, documents, few-shot examples), or whole turns of a chat (a system or user message and
  its answers; turns trade places only with turns of the same roles). Fix: every prompt lists
  the parts it shares with others in the order the parts were first seen together; a numbered
  header ("Example 2:") stays in its place and the part's body moves. Parts are compared
  exactly, so a part that also differs in its text (or in whitespace) is not seen as the same.
* ``near-duplicate``: texts that differ only in CRLF vs LF, spaces at line ends, doubled spaces,
  leading/trailing whitespace, or a chat message that carries chat-template markup itself (the
  template applied twice: ChatML or Llama 3 markup, one message or a whole conversation). Fix:
  normalise them all the same way; a normalisation that would change every prompt is left out
  (they agree on it). Markup in plain-text prompts is left as it is: there it is the prompt.
* ``short-prefix``: prompts share a prefix with an earlier prompt, but less than one block, so
  nothing is reused. Fix (a setting): the largest block size of ``SMALLER_BLOCK_SIZES`` that
  holds the typical such prefix.
* ``truncated-history``: a chat request continues an earlier request's conversation (it holds
  that request's last message and mostly its messages) but dropped or summarised older turns,
  so everything after the cut is recomputed. Fix: keep the history append-only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from functools import cmp_to_key

from .layout_prompts import (
    CONTEXT_CHARS,
    MIN_TOKENS,
    Finding,
    _clip,
    _Example,
    _first_text,
    _Layout,
    _lcp,
    _message_key,
    _side_by_side,
    _with_first_text,
)

Prompt = str | list[dict]
Encode = Callable[[Prompt], list[int]]
Decode = Callable[[Sequence[int]], str]
Measure = Callable[[list[Prompt], int], int]
Tokens = tuple[int, ...]

# Block sizes short-prefix may suggest, largest first (each below the current one).
SMALLER_BLOCK_SIZES = (128, 64, 32, 16)
# varying-first: at most this many leading lines, each at most this long, count as varying.
LEAD_LINES = 3
SHORT_LINE = 200
# reordered: a text with more shared parts than this is left as it is (pairs grow as n^2).
MAX_PARTS = 64


def find_layout_findings(
    prompts: list[Prompt],
    encode: Encode,
    decode: Decode,
    block_size: int,
    measure: Measure,
    max_findings: int = 5,
) -> list[Finding]:
    """The layout findings of `prompts` (in arrival order), ranked by measured gain."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    prompts = list(prompts)
    if len(prompts) < 2 or max_findings <= 0:
        return []
    layout = _Layout.of(prompts, encode, decode, block_size)
    found = [f for detect in _DETECTORS if (f := detect(layout)) is not None]
    if not found:
        return []
    base = measure(list(prompts), block_size)
    measured = []
    for finding in found:
        if finding.setting is not None:
            after = measure(list(prompts), finding.setting["block_size"])
        else:
            after = measure(list(finding.rewritten or prompts), block_size)
        measured.append(replace(finding, gain_tokens=after - base))
    # Sorting by gain alone puts fixes that measure no gain after every one that does.
    measured.sort(key=lambda f: (-(f.gain_tokens or 0), -f.tokens_lost))
    return measured[:max_findings]


# -- varying-first --------------------------------------------------------------------------------


def _varying_first(layout: _Layout) -> Finding | None:
    """Varying lines at the start of the first text, before text shared with other prompts."""
    heads = [_first_text(p) for p in layout.prompts]
    lines = [h.splitlines(keepends=True) if h else [] for h in heads]
    # In how many prompts each line occurs: shared text occurs in many, a timestamp in one.
    df = Counter(key for ls in lines for key in {line.strip() for line in ls} if key)
    leads = [_varying_lead(ls, df) for ls in lines]
    if not any(leads):
        return None
    bodies = ["".join(ls[k:]) for ls, k in zip(lines, leads)]
    ends = _shared_ends(bodies)
    rewritten = list(layout.prompts)
    moved: dict[int, str] = {}
    for i, k in enumerate(leads):
        if k and ends[i]:
            moved[i] = "".join(lines[i][:k]).strip()
            text = _move_after(moved[i], bodies[i], ends[i])
            rewritten[i] = _with_first_text(layout.prompts[i], text)

    def describe(ex: _Example) -> tuple[str, str]:
        src = ex.i if ex.i in moved else ex.changed[0]
        line = _clip(moved[src].splitlines()[0], CONTEXT_CHARS)
        prompt = layout.prompts[src]
        if isinstance(prompt, str):
            where, to = "the prompt", "just before the text that differs between prompts"
        else:
            role = prompt[0].get("role", "first")
            where = f"the {role} message"
            to = f"to where the shared part of the {role} message ends, so it keeps its role"
        return (
            f'a varying line ("{line}") stands before {ex.shared} shared tokens at the start '
            f"of {where} in {len(ex.changed)} of {ex.total} prompts",
            f"move the varying line after the shared text, {to}",
        )

    return layout.finding("varying-first", rewritten, describe)


def _varying_lead(lines: list[str], df: Counter) -> int:
    """How many leading lines vary (0: none): up to LEAD_LINES short lines, each found in at
    most half as many prompts as the line after them, which is found in two or more."""
    lead_df: list[int] = []
    for k, line in enumerate(lines):
        key = line.strip()
        if not key:  # a blank line goes with the varying lines above it
            continue
        if lead_df and df[key] >= 2 and 2 * max(lead_df) <= df[key]:
            return k
        if len(lead_df) == LEAD_LINES or len(key) > SHORT_LINE:
            return 0
        lead_df.append(df[key])
    return 0


def _shared_ends(texts: list[str]) -> list[int]:
    """Per text: where the text it shares with another text ends, at a line start (0: shares
    less than a line). Sorted, a text's longest shared prefix is with a neighbour."""
    common = [0] * len(texts)
    order = sorted((t, i) for i, t in enumerate(texts) if t)
    for (a, i), (b, k) in zip(order, order[1:]):
        n = _lcp(a, b)
        common[i], common[k] = max(common[i], n), max(common[k], n)
    ends = []
    for text, n in zip(texts, common):
        ends.append(n if n and n == len(text) else text.rfind("\n", 0, n) + 1)
    return ends


def _move_after(moved: str, body: str, end: int) -> str:
    """`body` with the line(s) `moved` put at `end` (a line start, or the end of the body)."""
    if end < len(body):
        return body[:end] + moved + "\n" + body[end:]
    if body.endswith("\n"):
        return body + moved + "\n"
    return body + "\n" + moved


# -- reordered ------------------------------------------------------------------------------------

# A part ends at a blank line, or where a header-like line starts one (markdown headers,
# <tool>/<document> tags, "Tool: ...", "Document 3:", "Example 2:").
_PART_BREAK = re.compile(
    r"(\n(?:[ \t]*\n)+|\n(?=#{1,6} |<(?:tool|function|document|doc|example)\b"
    r"|(?:tool|function|document|doc|example|source)\b[^\n]{0,60}:))",
    re.IGNORECASE,
)


# A numbered header at the start of a part ("Example 2:", "Document 3.", "## Tool 1"): it
# numbers the place, not the part, so it stays in its place while the part's body moves.
_NUMBERED = re.compile(
    r"(?:#{1,6} )?(?:example|document|doc|tool|shot|sample|source)\s*#?\d+\s*[:.)]?[ \t]*\n?",
    re.IGNORECASE,
)


def _reordered(layout: _Layout) -> Finding | None:
    """The same parts (of a text, or turns of a chat) in another order than first seen."""
    texts = [[p] if isinstance(p, str) else [m.get("content") for m in p] for p in layout.prompts]
    pieces = [[_PART_BREAK.split(t) if isinstance(t, str) else None for t in ts] for ts in texts]
    # Parts sit at even indices and separators at odd ones. Separators and numbered headers
    # keep their places; the rest of each part (its body) moves.
    splits = [x for row in pieces for x in row if x is not None]
    heads = [[n.end() if (n := _NUMBERED.match(part)) else 0 for part in x[0::2]] for x in splits]
    bodies = [[part[n:] for part, n in zip(x[0::2], cut)] for x, cut in zip(splits, heads)]
    orders = _canonical_orders(bodies)
    joined = iter(_join_parts(x, cut, order) for x, cut, order in zip(splits, heads, orders))
    rewritten = [
        _with_texts(prompt, [None if x is None else next(joined) for x in row])
        for prompt, row in zip(layout.prompts, pieces)
    ]
    rewritten = _reorder_turns(rewritten)
    rewritten = [new if new != old else old for new, old in zip(rewritten, layout.prompts)]

    def describe(ex: _Example) -> tuple[str, str]:
        mine, theirs = layout.line_at(ex.i, ex.at), layout.line_at(ex.j, ex.at)
        return (
            f"the same parts (tools, documents or examples) come in another order in "
            f'{len(ex.changed)} of {ex.total} prompts: prompt {ex.i} has "{mine}" where '
            f'prompt {ex.j} has "{theirs}"',
            "put the shared parts in one fixed order in every prompt (the order they were "
            "first seen in)",
        )

    return layout.finding("reordered", rewritten, describe)


def _join_parts(pieces: list[str], heads: list[int], bodies: list[str]) -> str:
    """A split text put back with `bodies` in its parts' places, after their headers."""
    out = list(pieces)
    out[0::2] = [part[:n] + body for part, n, body in zip(pieces[0::2], heads, bodies)]
    return "".join(out)


def _with_texts(prompt: Prompt, texts: list) -> Prompt:
    if isinstance(prompt, str):
        return texts[0]
    return [m if t is None or t == m.get("content") else {**m, "content": t}
            for m, t in zip(prompt, texts)]  # fmt: skip


def _reorder_turns(prompts: list[Prompt]) -> list[Prompt]:
    """Chats with their shared turns in first-seen order. A turn is a system or user message
    and the messages that answer it; turns move only among turns of the same roles, so the
    roles keep alternating as before."""
    chats = [i for i, p in enumerate(prompts) if isinstance(p, list)]
    turns: dict[tuple, list[dict]] = {}
    seqs = []
    for i in chats:
        seq = []
        for turn in _turns(prompts[i]):
            key = tuple((m.get("role"), _message_key(m)) for m in turn)
            turns[key] = turn
            seq.append(key)
        seqs.append(seq)
    out = list(prompts)
    for i, seq in zip(chats, _canonical_orders(seqs, cls=lambda key: tuple(r for r, _ in key))):
        out[i] = [m for key in seq for m in turns[key]]
    return out


def _turns(messages: list[dict]) -> list[list[dict]]:
    turns: list[list[dict]] = []
    for message in messages:
        if not turns or message.get("role") in ("system", "user"):
            turns.append([])
        turns[-1].append(message)
    return turns


def _canonical_orders(
    seqs: list[list[Hashable]], cls: Callable[[Hashable], Hashable] = lambda key: None
) -> list[list[Hashable]]:
    """Each sequence with the items it shares with other sequences put in canonical order.

    Two items go in the order of the first sequence that holds both. That is not a plain
    first-seen ranking: the first sequence holding only one of them says nothing about which
    goes first, and a ranking would reorder sequences no other one contradicts. Only items of
    the same class (`cls`) trade places; items no other sequence holds keep theirs.
    """
    df = Counter(k for s in seqs for k in set(s))
    ahead: dict[frozenset, Hashable] = {}
    for s in seqs:
        shared = [k for k in dict.fromkeys(s) if df[k] >= 2]
        if len(shared) <= MAX_PARTS:
            for x, a in enumerate(shared):
                for b in shared[x + 1 :]:
                    ahead.setdefault(frozenset((a, b)), a)

    def order(a: Hashable, b: Hashable) -> int:
        if a == b:
            return 0
        return -1 if ahead.get(frozenset((a, b)), a) == a else 1

    out = []
    for s in seqs:
        new = list(s)
        if len({k for k in s if df[k] >= 2}) <= MAX_PARTS:
            for c in {cls(k) for k in s}:
                slots = [p for p, k in enumerate(s) if df[k] >= 2 and cls(k) == c]
                for p, k in zip(slots, sorted((s[p] for p in slots), key=cmp_to_key(order))):
                    new[p] = k
        out.append(new)
    return out


# -- near-duplicate -------------------------------------------------------------------------------

_CRS = re.compile(r"\r\n?")
_LINE_END_SPACE = re.compile(r"[ \t]+(?=\n)")
_DOUBLE_SPACE = re.compile(r"(?<=\S) {2,}(?=\S)")  # not at a line start: indentation stays
_CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\s*", re.DOTALL)
_LLAMA3 = re.compile(
    r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>\s*", re.DOTALL
)
_GENERATION_PROMPTS = ("", "<|im_start|>assistant", "<|start_header_id|>assistant<|end_header_id|>")


def _each_text(fix: Callable[[str], str]) -> Callable[[Prompt], Prompt]:
    """A text fix applied to a prompt's text or to each message's; the same object back where
    it changes nothing."""

    def apply(prompt: Prompt) -> Prompt:
        if isinstance(prompt, str):
            new = fix(prompt)
            return prompt if new == prompt else new
        new_texts = [fix(m["content"]) if isinstance(m.get("content"), str) else None
                     for m in prompt]  # fmt: skip
        new = _with_texts(prompt, new_texts)
        return prompt if new == prompt else new

    return apply


def _templated_messages(text: str) -> list[tuple[str, str]] | None:
    """The (role, content) messages a text is made of, where it is chat-template markup."""
    body = text.strip().removeprefix("<|begin_of_text|>")
    for pattern in (_CHATML, _LLAMA3):
        found, pos = [], 0
        for match in pattern.finditer(body):
            if match.start() != pos:
                break
            found.append((match.group(1), match.group(2)))
            pos = match.end()
        if found and body[pos:].strip() in _GENERATION_PROMPTS:
            return found
    return None


def _untemplate(prompt: Prompt) -> Prompt:
    """A chat whose messages carry template markup, as the messages that markup spells."""
    if isinstance(prompt, str):
        return prompt
    out: list[dict] = []
    for m in prompt:
        inner = _templated_messages(m["content"]) if isinstance(m.get("content"), str) else None
        if inner:
            out.extend({**m, "role": role, "content": content} for role, content in inner)
        else:
            out.append(m)
    return prompt if out == prompt else out


# (what differs, what the fix makes it, the fix), in this order: CRs first, since they hide
# the newline the template markup and line-end spaces are matched by; the markup before the
# whitespace, so that markup's own trailing newline is not reported as a whitespace difference.
_NORMALISATIONS: tuple[tuple[str, str, Callable[[Prompt], Prompt]], ...] = (
    ("CRLF line endings", "LF line endings", _each_text(lambda t: _CRS.sub("\n", t))),
    ("a chat template applied twice (markup inside a message)", "messages sent untemplated",
     _untemplate),
    ("spaces at line ends", "none at line ends", _each_text(lambda t: _LINE_END_SPACE.sub("", t))),
    ("doubled spaces", "single spaces", _each_text(lambda t: _DOUBLE_SPACE.sub(" ", t))),
    ("leading whitespace", "none at the start", _each_text(str.lstrip)),
    ("trailing whitespace (e.g. a newline at the end)", "none at the end",
     _each_text(str.rstrip)),
)  # fmt: skip


def _near_duplicates(layout: _Layout) -> Finding | None:
    """Texts that differ in whitespace, line endings or doubled chat templating."""
    current = list(layout.prompts)
    used: list[str] = []
    what: dict[int, list[str]] = {}
    for name, result, fix in _NORMALISATIONS:
        trial = [fix(p) for p in current]
        hits = [i for i, (new, old) in enumerate(zip(trial, current)) if new is not old]
        # A difference every prompt has is not one between them: leave it as it is.
        if 0 < len(hits) < len(current):
            current = trial
            used.append(result)
            for i in hits:
                what.setdefault(i, []).append(name)

    def describe(ex: _Example) -> tuple[str, str]:
        names = what.get(ex.i) or what[ex.changed[0]]
        return (
            f"{len(ex.changed)} of {ex.total} prompts differ from the others in "
            f"{' and '.join(names)}, so prompt {ex.i} parts from prompt {ex.j} at token "
            f"{ex.at} instead of sharing {ex.shared} tokens",
            f"normalise every prompt the same way before sending it ({', '.join(used)})",
        )

    return layout.finding("near-duplicate", current, describe)


# -- short-prefix ---------------------------------------------------------------------------------


def _short_prefix(layout: _Layout) -> Finding | None:
    """Prompts share a prefix with an earlier one, but less than a block, so none is reused."""
    size = layout.block_size
    short = [i for i, n in enumerate(layout.before) if MIN_TOKENS <= n < size]
    if not short:
        return None
    lengths = sorted(layout.before[i] for i in short)
    typical = lengths[(len(lengths) - 1) // 2]  # the median: a size that holds most of them
    fits = [s for s in SMALLER_BLOCK_SIZES if s < size and s <= typical]
    if not fits:
        return None
    smaller = fits[0]
    i = max(short, key=lambda k: (layout.before[k], -k))
    j = layout.partner[i]
    at = layout.before[i]
    left, right = _side_by_side(layout.tokens[i], layout.tokens[j], at, layout.decode)
    spread = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    return Finding(
        kind="short-prefix",
        cause=(
            f"{len(short)} of {len(layout.prompts)} prompts share {spread} tokens with an "
            f"earlier prompt, less than one block of {size}, so none of it is reused"
        ),
        fix=f"use block size {smaller}: only whole blocks are shared, and {smaller} holds it",
        prompts=tuple(short),
        pair=(i, j),
        part_at=at,
        left=left,
        right=right,
        tokens_lost=sum(lengths),
        rewritten=None,
        gain_tokens=None,
        setting={"block_size": smaller},
    )


# -- truncated-history ----------------------------------------------------------------------------


def _truncated_history(layout: _Layout) -> Finding | None:
    """Chat requests that continue an earlier request but cut its history short."""
    keys = [[_message_key(m) for m in p] if isinstance(p, list) else None for p in layout.prompts]
    # Requests by the key of their last message: a later request of the same conversation
    # holds that message, so this finds the candidates without comparing every pair.
    by_last: dict[str, list[int]] = {}
    rewritten = list(layout.prompts)
    earlier: dict[int, int] = {}
    how: dict[int, str] = {}
    for i, seq in enumerate(keys):
        if not seq:
            continue
        found = _continued(layout.prompts, keys, by_last, i)
        if found is not None:
            j, cut = found
            # The earlier request's messages (as rewritten: a chain stays append-only), then
            # what this request adds after that request's last message.
            rewritten[i] = [*rewritten[j], *layout.prompts[i][cut + 1 :]]
            earlier[i] = j
            kept = set(keys[j])
            lost_turns = any(k not in kept for k in seq[: cut + 1])
            how[i] = "replace older turns with a summary" if lost_turns else "drop the oldest turns"
        by_last.setdefault(seq[-1], []).append(i)

    def describe(ex: _Example) -> tuple[str, str]:
        kinds = sorted({how[k] for k in ex.changed})
        return (
            f"{len(ex.changed)} of {ex.total} requests continue an earlier request's "
            f"conversation but {' or '.join(kinds)} (request {ex.i} cuts the history of "
            f"request {ex.j} at token {ex.at}), so everything after the cut is recomputed",
            "keep each conversation's history append-only: resend the earlier messages "
            "unchanged and add new turns after them (if the context fills, cut once, at a "
            "turn boundary, and keep appending after the cut)",
        )

    return layout.finding("truncated-history", rewritten, describe, partner_of=earlier)


def _continued(
    prompts: list[Prompt], keys: list[list[str] | None], by_last: dict[str, list[int]], i: int
) -> tuple[int, int] | None:
    """(j, cut) where request `i` continues the conversation of the earlier request `j` but
    not as an extension of it: `i` holds j's last message at `cut` and adds messages after
    it, and at least half of its messages up to `cut` are j's. None where the latest such
    earlier request is extended properly, or there is none."""
    seq = keys[i]
    best: tuple[int, int] | None = None
    for cut, key in enumerate(seq[:-1]):
        # The latest request that ended with this message (lists grow in request order); of
        # equals, the message's last place in `i`.
        if (later := by_last.get(key)) and (best is None or later[-1] >= best[0]):
            best = (later[-1], cut)
    if best is None:
        return None
    j, cut = best
    prior = keys[j]
    if seq[: cut + 1] == prior:  # an extension: the cache already serves it
        return None
    turns = sum(m.get("role") != "system" for m in prompts[j])
    kept = set(prior)
    if turns < 2 or 2 * sum(k in kept for k in seq[: cut + 1]) < cut + 1:
        return None
    return j, cut


_DETECTORS: tuple[Callable[[_Layout], Finding | None], ...] = (
    _varying_first,
    _reordered,
    _near_duplicates,
    _short_prefix,
    _truncated_history,
)
