"""Issue #48: ``nanokv advise`` names the prompt-layout mistakes that cost the most, each fix
ranked with the settings changes by a measured gain; draws the hit rate against the cache's
size and over the requests; and writes it all as one page (``--html``) whose numbers are the
``--json``'s. Real tokenizer (the default model's), dry runs only; the pages open in headless
Chromium with the network off (``support.browser``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.browser import embedded, load
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.engine.model.loader import load_model
from nanokv_cli.views.pages import advise_report, replay_report

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"
MOONCAKE_FLAGS = ("--limit", "150", "--block-size", "512", "--num-blocks", "400")
runner = CliRunner()

# ~170 tokens of policy that every support prompt starts with.
POLICY = "\n".join(
    [
        "You are the support assistant of Northwind Outfitters. Follow this policy in every reply.",
        "Greet the customer once, by name when it is known, and keep a calm, friendly tone.",
        "Orders ship within two working days; tracking links are emailed once the parcel leaves.",
        "Returns are accepted within thirty days if the item is unused and in its original box.",
        "Refunds go back to the original card within ten working days of the return arriving.",
        "Never promise a delivery date that the carrier has not confirmed in writing.",
        "Escalate threats, legal questions and personal data requests to a human agent at once.",
        "Quote prices with their currency and say whether sales tax is included or not.",
        "Keep every answer under eighty words and end it with one short follow-up question.",
    ]
)
QUESTIONS = [
    "Where is my parcel?", "Can I return shoes I wore once?", "Do you deliver to Norway?",
    "Why was my card charged twice?", "How do I change my address?",
    "Is the blue jacket back in stock?", "My zip broke after a week.", "Can I pay with PayPal?",
    "Do you price match?", "Where is my refund?", "Can I cancel my order?",
    "Do you sell gift cards?",
]  # fmt: skip
TICKET = "Ticket opened at 09:01."
TICKETS = (3, 6, 9)  # the prompts with the ticket line before the policy


def ok(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def advise(path: Path, *args) -> dict:
    return json.loads(ok("advise", path, "--json", *args))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({**r, "max_tokens": 8}) + "\n" for r in rows))
    return path


def ticket_prompts(ticket_first: bool) -> list[str]:
    out = []
    for k, q in enumerate(QUESTIONS):
        if k not in TICKETS:
            out.append(f"{POLICY}\nCustomer {k}: {q}")
        elif ticket_first:
            out.append(f"{TICKET}\n{POLICY}\nCustomer {k}: {q}")
        else:  # the fix: the ticket line where the shared text ends
            out.append(f"{POLICY}\n{TICKET}\nCustomer {k}: {q}")
    return out


def top_finding(advice: dict) -> dict:
    """The first change: a layout finding's fix, with a measured gain."""
    top = advice["changes"][0]
    finding = top["finding"]
    assert finding is not None, advice["changes"]
    assert top["rank"] == finding["rank"] == 1
    assert top["tokens_saved"] == finding["gain_tokens"] > 0 and top["gain"] > 0
    assert top["kind"] == "layout" and top["layout"] == finding["kind"]
    return finding


# -- the example --------------------------------------------------------------------------


def test_the_ticket_line_is_named_and_moving_it_ranks_first(tmp_path):
    path = write_jsonl(tmp_path / "tickets.jsonl", [{"prompt": p} for p in ticket_prompts(True)])
    advice = advise(path)
    finding = top_finding(advice)
    assert finding["kind"] == "varying-first" and f'"{TICKET}"' in finding["cause"]
    assert finding["prompts"] == len(TICKETS)
    # The two texts where they part: the ticket line against the policy that opens the other.
    assert finding["left"].startswith(f"▸{TICKET}\\nYou are the support assistant")
    assert finding["right"].startswith("▸You are the support assistant")
    assert finding["tokens_lost"] > 100
    # Its gain is a dry run of the prompts with the line moved, as replay runs that file.
    moved = write_jsonl(tmp_path / "moved.jsonl", [{"prompt": p} for p in ticket_prompts(False)])
    row = next(r for r in advice["grid"] if r["layout"] == "varying-first")
    replay = json.loads(ok("replay", moved, "--dry-run", "--json", "--max-tokens", "8"))
    assert (replay["hit_rate"], replay["cache_hits"]) == (row["hit_rate"], row["cache_hits"])
    # The terminal says the same: cause, both texts, tokens lost, measured gain.
    out = " ".join(ok("advise", path).split())
    assert f'cause: a varying line ("{TICKET}")' in out
    assert f"this: ▸{TICKET}" in out and "earlier: ▸You are the support" in out
    assert f"{finding['tokens_lost']:,} shared prompt tokens not reused" in out
    assert f"+{finding['gain_tokens']:,} tokens from the cache with the fix" in out
    assert "none of the grid's changes raises the hit rate" not in out


# -- the other kinds of layout mistake ------------------------------------------------------------

TOOLS = {
    "search": '<tool name="search">Search the product catalogue by keyword, colour, size and '
    "price range; returns at most twenty items with their stock levels.</tool>",
    "orders": '<tool name="orders">Look up a customer\'s orders by email address or order '
    "number; returns the items, the totals, the payment state and the tracking link.</tool>",
    "refund": '<tool name="refund">Start a refund for an order line that was returned; needs '
    "the order number, the line and the reason, and says when the money arrives.</tool>",
}
TURNS = [
    ("user", "Hi, I ordered a jacket last week and it has not arrived yet. Order 5531."),
    ("assistant", "Sorry to hear that. Order 5531 left our warehouse on Monday; the carrier "
     "shows it in transit to your city."),
    ("user", "Can you tell me when it will arrive? I need it for a trip on Friday."),
    ("assistant", "The carrier has not confirmed a date yet. I can ask them and write back to "
     "you today."),
    ("user", "Please do. Also, can I change the delivery address to my office?"),
    ("assistant", "Yes: give me the office address and I will ask the carrier to redirect it."),
    ("user", "It is 12 Harbour Street, Leeds. Thanks!"),
    ("assistant", "Done: the carrier will redirect it to 12 Harbour Street. Anything else?"),
    ("user", "No, that is all."),
]  # fmt: skip


def reordered_rows() -> list[dict]:
    rows = []
    for k, q in enumerate(QUESTIONS[:8]):
        order = ("search", "orders", "refund") if k % 3 else ("orders", "search", "refund")
        tools = "\n\n".join(TOOLS[t] for t in order)
        rows.append({"prompt": f"You can call these tools.\n\n{tools}\n\nUser: {q}"})
    return rows


def near_duplicate_rows() -> list[dict]:
    prompts = [f"{POLICY}\nUser: {q}" for q in QUESTIONS[:8]]
    return [
        {"prompt": p.replace("\n", "\r\n") if k in (2, 5) else p} for k, p in enumerate(prompts)
    ]


def truncated_history_rows() -> list[dict]:
    """One conversation, each request its history so far; from the fourth turn on the client
    keeps the last five messages only."""
    system = {"role": "system", "content": POLICY}
    rows = []
    for end in (1, 3, 5, 7, 9):
        turns = TURNS[:end] if end < 7 else TURNS[end - 5 : end]
        rows.append({"messages": [system, *({"role": r, "content": c} for r, c in turns)]})
    return rows


@pytest.mark.parametrize(
    ("rows", "kind", "cause"),
    [
        (reordered_rows, "reordered", "the same parts (tools, documents or examples) come in"),
        (near_duplicate_rows, "near-duplicate", "differ from the others in CRLF line endings"),
        (truncated_history_rows, "truncated-history", "continue an earlier request's conversation"),
    ],
    ids=["reordered", "near-duplicate", "truncated-history"],
)
def test_each_kind_of_layout_mistake_is_named_and_its_fix_ranks_first(tmp_path, rows, kind, cause):
    # One second apart: each prompt is computed (and cached) before the next arrives.
    timed = [{**r, "timestamp": i} for i, r in enumerate(rows())]
    path = write_jsonl(tmp_path / f"{kind}.jsonl", timed)
    advice = advise(path)
    finding = top_finding(advice)
    assert finding["kind"] == kind and cause in finding["cause"], finding
    assert "▸" in finding["left"] and "▸" in finding["right"] and finding["tokens_lost"] > 0


# -- the capacity curve and the timeline ------------------------------------------------------------


def test_the_capacity_curve_and_the_timeline_are_the_dry_runs(tmp_path):
    path = write_jsonl(tmp_path / "tickets.jsonl", [{"prompt": p} for p in ticket_prompts(True)])
    advice = advise(path, "--block-size", "16", "--num-blocks", "64")
    curve = advice["capacity_curve"]
    points = curve["points"]
    sizes = [p["num_blocks"] for p in points]
    assert sizes == sorted(set(sizes)) and 6 <= len(points) <= 12
    never = advice["bounds"]["infinite_cache"]
    assert sizes[-1] == never["num_blocks"] and points[-1]["hit_rate"] == never["hit_rate"]
    assert points[0]["hit_rate"] < points[-1]["hit_rate"]  # a small cache evicts
    # Each point is a run of the grid at that cache size, and equals its own replay.
    sized = ("now", "bound", "cache", "capacity")  # runs at the settings now, but the size
    rows = {(r["block_size"], r["num_blocks"]): r for r in advice["grid"] if r["kind"] in sized}
    config = load_model(None).config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    assert curve["kv_bytes_per_token"] == per_token and curve["kv_dtype"] == "float16"
    for p in points:
        row = rows[(16, p["num_blocks"])]
        assert (p["hit_rate"], p["cache_hits"]) == (row["hit_rate"], row["cache_hits"])
        assert p["cache_tokens"] == 16 * p["num_blocks"]
        assert p["cache_gib"] == p["cache_tokens"] * per_token / 2**30
        assert p["ideal_speedup"] == 1 / (1 - p["hit_rate"])
        assert p["now"] == (p["num_blocks"] == 64)
    small = points[0]
    report = json.loads(ok("replay", path, "--dry-run", "--json", "--max-tokens", "8",
                           "--block-size", "16", "--num-blocks", small["num_blocks"]))  # fmt: skip
    assert (report["hit_rate"], report["cache_hits"]) == (small["hit_rate"], small["cache_hits"])
    assert curve["ceiling"] == advice["bounds"]["token_level"]["hit_rate"]
    assert curve["current_tokens"] == 16 * 64 and any(p["now"] for p in points)
    # The timeline is the run now, request by request: its sums are the run's counters.
    now, timeline = advice["now"], advice["timeline"]
    assert [t["request"] for t in timeline] == list(range(len(QUESTIONS)))
    assert sum(t["prompt_tokens"] for t in timeline) == now["cache_queries"]
    assert sum(t["hit_tokens"] for t in timeline) == now["cache_hits"]
    missed: dict[str, int] = {}
    for t in timeline:
        for reason, n in t["misses"].items():
            missed[reason] = missed.get(reason, 0) + n
    assert missed == {lim["reason"]: lim["tokens"] for lim in advice["limits"]}
    out = ok("advise", path, "--block-size", "16", "--num-blocks", "64")
    assert (
        "Hit rate by cache size" in out and "◀ now" in out and "Hit rate over the requests" in out
    )
    assert f"{points[0]['cache_tokens']:,}" in out and f"{points[0]['ideal_speedup']:.2f}×" in out


# -- the pages ----------------------------------------------------------------------------------------


def test_the_mooncake_advice_page_draws_offline_with_the_json_numbers(tmp_path):
    page = tmp_path / "advice.html"
    advice = json.loads(ok("advise", MOONCAKE, *MOONCAKE_FLAGS, "--json", "--html", page))
    loaded = load(page, tmp_path)
    assert loaded.console == [] and loaded.requests == []
    dom = loaded.dom
    for chart in ("capacity-chart", "timeline-hit-chart", "timeline-miss-chart", "grid-heatmap"):
        assert dom.find(dom.by_id(chart), tag="svg", cls="main-svg"), f"{chart} drew no SVG"
    # The page is drawn from the JSON, key by key: the data it carries is that.
    data = embedded(dom)
    assert data == advise_report(advice)
    assert data["capacity_curve"] == advice["capacity_curve"]
    assert data["timeline"] == advice["timeline"] and data["grid"]["rows"] == advice["grid"]
    # ... and what it shows: the curve's table, the grid's cells.
    curve = advice["capacity_curve"]["points"]
    rows = dom.find(dom.by_id("capacity-table"), tag="tr")[1:]
    assert [float(r.attrs["data-hit-rate"]) for r in rows] == [p["hit_rate"] for p in curve]
    assert [int(r.attrs["data-cache-tokens"]) for r in rows] == [p["cache_tokens"] for p in curve]
    cells = dom.find(dom.by_id("grid-table"), tag="td")
    rates = [
        json.loads(td.attrs["data-value"]) for td in cells if td.attrs["data-col"] == "hit_rate"
    ]
    assert rates == [r["hit_rate"] for r in advice["grid"]]
    ranks = [int(li.attrs["data-rank"]) for li in dom.find(tag="li") if "data-rank" in li.attrs]
    assert ranks == [c["rank"] for c in advice["changes"]]


def test_the_replay_grid_page_draws_offline_with_the_json_numbers(tmp_path):
    page = tmp_path / "replay.html"
    args = ("replay", REPO / "examples" / "prompts.jsonl", "--dry-run", "--block-size", "16,64")
    reports = json.loads(ok(*args, "--num-blocks", "20,400", "--json", "--html", page))
    loaded = load(page, tmp_path)
    assert loaded.console == [] and loaded.requests == []
    dom = loaded.dom
    assert dom.find(dom.by_id("replay-bars"), tag="svg", cls="main-svg")
    assert embedded(dom) == replay_report(reports)
    cells = dom.find(dom.by_id("replay-table"), tag="td")
    rates = [
        json.loads(td.attrs["data-value"]) for td in cells if td.attrs["data-col"] == "hit_rate"
    ]
    assert rates == [r["hit_rate"] for r in reports] and len(rates) == 4


@pytest.mark.parametrize("command", ["advise", "replay"])
def test_a_bad_html_path_is_refused_in_one_line_before_the_run(tmp_path, command):
    prompts = REPO / "examples" / "prompts.jsonl"
    extra = ["--dry-run"] if command == "replay" else []
    for bad, why in [
        (tmp_path, "it is a directory"),
        (tmp_path / "missing" / "page.html", "does not exist"),
        (prompts, "that is an input of this run"),
        (Path("/dev/null"), "a character device"),
    ]:
        result = runner.invoke(app, [command, str(prompts), *extra, "--html", str(bad)])
        assert result.exit_code == 1, result.output
        assert result.stdout == "" and why in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["replay", str(prompts), "--html", str(tmp_path / "p.html")])
    assert result.exit_code == 2 and "--dry-run" in result.output
