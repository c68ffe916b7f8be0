"""Hostile and careless input the other issue-17 tests leave out, met where a user meets it
(findings 1, 3 and 9): hand-edited traces under ``nanokv inspect``, non-finite or absurd
arrival times under ``nanokv replay`` (dry run and model run), and two threads sharing one
``LLM``.

Every case runs in a subprocess under an address-space limit and a timeout, and asserts one
clear message and exit 1, or the right (degraded) result, and never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import msgpack
import pytest
import zstandard
from support.cli import MODEL_MEMORY, run_limited
from support.models import make_tiny_model
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.engine.core.events import BlockAllocated, CacheLookup, StepSnapshot
from nanokv_cli.trace.format import _CODE, _PREFIX, MAGIC, MAX_NUM_BLOCKS

runner = CliRunner()


def one_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 with one ``nanokv: error:`` line, the last, holding every fragment."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("nanokv: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def finite_json(text: str):
    """``text`` parsed, refusing NaN and Infinity (not JSON, though Python writes them)."""

    def refuse(constant: str):
        raise AssertionError(f"non-finite number {constant} in {text[:200]}")

    return json.loads(text, parse_constant=refuse)


# -- finding 9: traces -------------------------------------------------------------------------


def read_records(data: bytes) -> list[list]:
    """A version-2 trace's records as [kind, first, last, payload object]."""
    records, at = [], len(MAGIC)
    while at < len(data):
        n, kind, first, last = _PREFIX.unpack_from(data, at)
        raw = zstandard.ZstdDecompressor().decompress(
            data[at + _PREFIX.size : at + _PREFIX.size + n]
        )
        records.append([kind, first, last, msgpack.unpackb(raw, raw=False, strict_map_key=False)])
        at += _PREFIX.size + n
    return records


def pack_records(records: list[list], packed_header: bytes | None = None) -> bytes:
    """Records back to a trace; ``packed_header`` replaces the header's msgpack bytes."""
    z = zstandard.ZstdCompressor(write_checksum=True)
    out = [MAGIC]
    for i, (kind, first, last, obj) in enumerate(records):
        packed = (
            packed_header if i == 0 and packed_header else msgpack.packb(obj, use_bin_type=True)
        )
        payload = z.compress(packed)
        out.append(_PREFIX.pack(len(payload), kind, first, last) + payload)
    return b"".join(out)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tokenizer_dir) -> list[list]:
    """The records of a dry run's trace whose header names a tokenizer (so blocks have text)."""
    folder = tmp_path_factory.mktemp("trace")
    prompts = folder / "p.jsonl"
    shared = "A shared system prompt that spans several blocks of tokens. "
    prompts.write_text("\n".join(json.dumps({"prompt": shared + q}) for q in ("one?", "two?")))
    trace = folder / "run.trace"
    args = ["replay", prompts, "--dry-run", "--model", tokenizer_dir, "--block-size", "8"]
    args += ["--num-blocks", "64", "--max-tokens", "8", "--record", trace, "--json"]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    records = read_records(trace.read_bytes())
    assert records[0][3]["model"] == str(tokenizer_dir.resolve())
    assert not any(kind == b"C" for kind, *_ in records)  # the events alone rebuild the state
    return records


def inspect_json(path: Path, *extra: str) -> tuple[dict, list[str]]:
    """``inspect --json``: its output and its note lines; it must have succeeded."""
    result = run_limited(["inspect", path, "--json", *extra])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr
    return finite_json(result.stdout), [s for s in result.stderr.splitlines() if s.strip()]


def test_a_trace_whose_model_loads_shows_block_text(tmp_path, recorded):
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records(recorded))
    info, notes = inspect_json(path)
    assert notes == []
    assert info["blocks"] and all(isinstance(b["text"], str) for b in info["blocks"])


def test_a_trace_of_token_ids_only_shows_no_text_and_no_note(tmp_path, recorded):
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records([[b"H", 0, 0, {**recorded[0][3], "model": None}], *recorded[1:]]))
    info, notes = inspect_json(path)
    assert notes == [] and all(b["text"] is None for b in info["blocks"])


BAD_MODELS = {
    "an int": (17, "its model is 17"),
    "a list": (["model.gguf"], "its model is ['model.gguf']"),
    "an empty path": ("", "its model is ''"),
    "missing": (None, "the trace's header names no model"),
    "a missing path": ("{tmp}/gone.gguf", "No such file or directory"),
    "a FIFO": ("{tmp}/fifo", "is a FIFO, not a model"),
    "a device": ("/dev/zero", "is a character device, not a model"),
    "a folder with no tokenizer": ("{tmp}", "has no tokenizer.json"),
    "a file that is no model": ("{tmp}/t.trace", "is neither"),
}


RICH_VIEW = ("an int", "a list", "a FIFO")  # the view names the header's model


@pytest.mark.parametrize("name", list(BAD_MODELS))
def test_a_header_model_that_cannot_load_leaves_out_only_the_text(tmp_path, recorded, name):
    """The trace still opens: every block with its token ids, no text, and one note."""
    value, note = BAD_MODELS[name]
    os.mkfifo(tmp_path / "fifo")
    header = dict(recorded[0][3])
    if value is None:
        del header["model"]
    else:
        header["model"] = value.format(tmp=tmp_path) if isinstance(value, str) else value
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records([[b"H", 0, 0, header], *recorded[1:]]))
    info, notes = inspect_json(path)
    assert len(notes) == 1 and notes[0].startswith("nanokv: block text not shown: "), notes
    assert note in notes[0], notes[0]
    assert info["blocks"] and all(b["text"] is None for b in info["blocks"])
    assert all(b["token_ids"] for b in info["blocks"] if b["state"] != "free")
    if name not in RICH_VIEW:
        return
    result = run_limited(["inspect", path])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "blocks: used" in result.stdout


def with_field(records: list[list], event: type, index: int, value) -> list[list]:
    """The records with item ``index`` of the first ``event`` (its encoded list: the type
    code, then the fields in order) set to ``value``."""
    records = [list(r) for r in records]
    for r in records:
        items = [list(item) for item in r[3]] if r[0] == b"E" else []
        first = next((i for i, item in enumerate(items) if item[0] == _CODE[event]), None)
        if first is not None:
            items[first][index] = value
            r[3] = items
            return records
    raise AssertionError(f"no {event.__name__} recorded")


INSPECTS = ([], ["--step", "0"], ["--request", "0"], ["--export", "vllm-kv-events", "out.kv"])


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "BlockAllocated.block_id = -1 is out of range"),  # was block 63, silently
        (64, "BlockAllocated.block_id = 64 is out of range"),
        ("x", "BlockAllocated.block_id = 'x' is out of range"),
        (1.5, "BlockAllocated.block_id = 1.5 is out of range"),
        (None, "BlockAllocated.block_id = None is out of range"),
    ],
)
def test_a_bad_block_id_is_one_message(tmp_path, recorded, value, message):
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records(with_field(recorded, BlockAllocated, 2, value)))
    for extra in ([], ["--request", "0"]):  # with tokens, and without (the same checks)
        one_error(
            run_limited(["inspect", path, *extra]), f"{path}: a record does not hold", message
        )
    summary = run_limited(["inspect", path, "--summary"])  # counts records, reads no fields
    assert summary.returncode == 0 and "Traceback" not in summary.stderr, summary.stderr


# Each gave a traceback in at least one of INSPECTS (a sum, a comparison, a lookup).
BAD_FIELDS = [
    (StepSnapshot, 1, "x", "StepSnapshot.step = 'x' is not valid"),
    (StepSnapshot, 11, "x", "StepSnapshot.clock = 'x' is not valid"),
    (StepSnapshot, 12, "x", "StepSnapshot.queries = 'x' is not valid"),
    (StepSnapshot, 13, None, "StepSnapshot.hits = None is not valid"),
    (StepSnapshot, 21, [1], "StepSnapshot.miss_tokens = [1] is not valid"),
    (CacheLookup, 5, 7, "CacheLookup.reason = 7 is not valid"),
    (CacheLookup, 2, "x", "CacheLookup.num_tokens = 'x' is not valid"),
]


@pytest.mark.parametrize("event, index, value, message", BAD_FIELDS)
def test_a_field_of_the_wrong_type_is_one_message(tmp_path, recorded, event, index, value, message):
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records(with_field(recorded, event, index, value)))
    for extra in INSPECTS:
        one_error(run_limited(["inspect", path, *extra], cwd=tmp_path), str(path), message)


def test_a_checkpoint_that_does_not_fit_the_cache_is_one_message(tmp_path, recorded):
    last = max(r[2] for r in recorded if r[0] == b"E")
    checkpoint = {
        "ref_count": bytes(4 * 8),  # 8 blocks' worth; the header says 64
        "block_hash": [-1] * 8,
        "tables": [],
        "sources": [],
        "unfinished": [],
        "snapshot": [],
    }
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records([*recorded, [b"C", last, last, checkpoint]]))
    one_error(run_limited(["inspect", path]), f"{path}: damaged checkpoint", "do not fit 64 blocks")


@pytest.mark.parametrize("num_blocks", [10**9, 0, -1, "64", 64.0])
def test_a_header_cache_size_out_of_bounds_is_refused(tmp_path, recorded, num_blocks):
    """10**9 blocks was 1.7 GB and 21 s per 10**8 before it was refused."""
    header = {**recorded[0][3], "num_blocks": num_blocks}
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records([[b"H", 0, 0, header], *recorded[1:]]))
    one_error(
        run_limited(["inspect", path]),
        str(path),
        f"lacks a valid 'num_blocks' (1 to {MAX_NUM_BLOCKS:,})",
    )


def test_the_largest_header_cache_is_read_in_bounded_memory(tmp_path, recorded):
    header = {**recorded[0][3], "num_blocks": MAX_NUM_BLOCKS}
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records([[b"H", 0, 0, header], *recorded[1:]]))
    info, notes = inspect_json(path)
    assert notes == [] and info["counts"]["free"] > MAX_NUM_BLOCKS - 64


def test_bad_utf8_names_the_file_and_where(tmp_path, recorded):
    # Version 2: a header string that is not UTF-8 (msgpack str 8 of two bytes, \xff\xfe).
    header = dict(recorded[0][3], model="@@")
    packed = msgpack.packb(header, use_bin_type=True).replace(b"\xa2@@", b"\xa2\xff\xfe")
    path = tmp_path / "t.trace"
    path.write_bytes(pack_records(recorded, packed_header=packed))
    one_error(run_limited(["inspect", path]), str(path), "damaged record at byte 8", "utf-8")
    # Version 1 (JSONL): the bad bytes' own line, though they share a read-ahead chunk with
    # the lines before them.
    v1 = tmp_path / "v1.trace"
    good = tmp_path / "good.trace"
    good.write_bytes(pack_records(recorded))
    export = run_limited(["inspect", good, "--export", "jsonl", v1])
    assert export.returncode == 0, export.stderr
    lines = v1.read_bytes().splitlines(keepends=True)
    assert len(lines) > 8
    lines[7] = lines[7].replace(b'"', b'"\xff', 1)
    v1.write_bytes(b"".join(lines))
    one_error(run_limited(["inspect", v1]), f"{v1} line 8: not UTF-8 text")


# -- finding 3: arrival times --------------------------------------------------------------------


def mooncake(path: Path, timestamps: list[str]) -> Path:
    """A Mooncake trace of one short request per timestamp (written as given: NaN and
    Infinity are what Python's json writes and reads)."""
    path.write_text(
        "".join(
            f'{{"timestamp": {t}, "input_length": 40, "output_length": 4, "hash_ids": [{i}]}}\n'
            for i, t in enumerate(timestamps)
        )
    )
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # Mooncake prompts are synthesized over a 32,000-token vocabulary: the model must take it.
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny"), vocab_size=32000)


BAD_TIMESTAMPS = ["NaN", "Infinity", "-Infinity", "-1"]


@pytest.mark.parametrize("timestamp", BAD_TIMESTAMPS)
def test_a_non_finite_mooncake_timestamp_is_one_message(tmp_path, tiny_model, timestamp):
    """NaN looped forever (an arrival that never comes); Infinity wrote invalid JSON."""
    path = mooncake(tmp_path / "m.jsonl", ["0", timestamp])
    message = "line 2: timestamp must be a finite non-negative number"
    one_error(run_limited(["replay", path, "--dry-run", "--json"]), str(path), message)
    model_run = ["replay", path, "--model", tiny_model, "--json", "--max-tokens", "2"]
    one_error(run_limited(model_run, memory=MODEL_MEMORY), str(path), message)


@pytest.mark.parametrize("timestamp", BAD_TIMESTAMPS)
def test_a_non_finite_prompt_file_timestamp_is_one_message(tmp_path, timestamp):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "hello", "timestamp": {timestamp}}}\n')
    one_error(
        run_limited(["replay", path, "--dry-run", "--json"]), "'timestamp' must be a finite number"
    )


def test_a_rate_of_1e_300_gives_a_finite_report(tmp_path):
    path = mooncake(tmp_path / "m.jsonl", ["0", "10", "20"])
    report = tmp_path / "r.json"
    result = run_limited(
        ["replay", path, "--dry-run", "--rate", "1e-300", "--json", "--report", report]
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert finite_json(report.read_text()) == finite_json(result.stdout)
    assert 1e290 < finite_json(result.stdout)["duration_s"] < 1e308


def test_a_rate_whose_arrivals_overflow_is_one_message(tmp_path):
    # 5e-324 is the smallest float above 0: one gap of 1/rate is already past the largest.
    path = mooncake(tmp_path / "m.jsonl", ["0", "10", "20"])
    one_error(
        run_limited(["replay", path, "--dry-run", "--rate", "5e-324"]), "--rate 5e-324 is too low"
    )


def test_a_model_run_at_1e_300_per_second(tmp_path, tiny_model):
    """One request comes at once: the run ends with a finite report. A second would come in
    1e300 s (time.sleep overflowed): one message instead of a traceback or a wait for ever."""
    model_run = ["--model", tiny_model, "--rate", "1e-300", "--json", "--max-tokens", "2"]
    one = run_limited(["replay", mooncake(tmp_path / "one.jsonl", ["0"]), *model_run], MODEL_MEMORY)
    assert one.returncode == 0 and "Traceback" not in one.stderr, one.stderr[-3000:]
    assert finite_json(one.stdout)["rate"] == 1e-300
    two = run_limited(
        ["replay", mooncake(tmp_path / "two.jsonl", ["0", "1"]), *model_run], MODEL_MEMORY
    )
    one_error(two, "from now, more than a year", "--rate")


# -- finding 1: two threads, one LLM --------------------------------------------------------------

TWO_THREADS = textwrap.dedent(
    """
    import json, sys, threading
    from nanokv_cli import LLM, SamplingParams

    llm = LLM(sys.argv[1], dtype="float32", device="cpu", block_size=8, num_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shared = list(range(3, 40))
    prompts = [shared + [50 + i] * (5 + 3 * i) for i in range(3)]
    sequential = [[o["token_ids"] for o in llm.generate([p], greedy)] for p in prompts]
    sequential = [ids for one in sequential for ids in one]
    start = threading.Barrier(2)
    results, errors = {}, []

    def worker(k):
        start.wait()
        try:
            results[k] = [o["token_ids"] for o in llm.generate(prompts, greedy)]
        except BaseException as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"sequential": sequential, "results": results, "errors": errors}))
    """
)


def test_two_threads_generating_at_once_both_get_the_sequential_output(tiny_model):
    """It raised (a shape error in attention, a KeyError in llm.py) or returned other text."""
    result = run_limited([tiny_model], memory=MODEL_MEMORY, code=TWO_THREADS)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["errors"] == []
    assert out["results"] == {"0": out["sequential"], "1": out["sequential"]}
