"""Hostile and careless input (issue 17, findings 5 to 8): chat templates, output paths, huge
or endless inputs, values no parser expects.

Every case runs the CLI as a user would, in a subprocess under an address-space limit and a
timeout, and asserts a non-zero exit with one clear message (or the right result) and no
traceback. The model-free paths (``--dry-run``, ``inspect``) carry almost every case; the
hypothesis tests feed malformed prompt files and damaged traces through the CLI in process.
"""

from __future__ import annotations

import json
import os
import re
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.run.stats import json_text

# Address space for a CLI run: every case here stays off torch (dry runs, inspect, errors
# before a model loads), and such a run works under 1 GiB (a model run needs ~2 GiB: torch
# reserves much it never touches). 1.5 GiB leaves room, far below what the findings blew up
# to (4 to 40 GB).
DRY_RUN_MEMORY = 3 << 29
TIMEOUT_S = 60  # each case takes about a second; a hang would take forever

runner = CliRunner()


def run_cli(
    *args: str | bytes | Path,
    memory: int = DRY_RUN_MEMORY,
    stdin=None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nanokv_cli.cli",
            *(a if isinstance(a, bytes) else str(a) for a in args),
        ],
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
        preexec_fn=limit_memory,
        cwd=cwd,
    )


def one_error(result, *fragments: str, code: int = 1) -> str:
    """The run failed with exit ``code`` and one message holding every fragment."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == code, output
    if code == 1:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("nanokv: error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
        message = errors[0]
    else:  # a usage error: Typer's box; its lines joined
        message = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("The first prompt\nThe second prompt\n")
    return path


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# -- 5: chat templates -------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "nested loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "longer than 2 s",
    ),
    "huge repeat": ("{{ 'x' * 10**9 }}", "1,000,000,000 characters"),
    "huge range": ("{{ range(10**9) | list }}", "too large"),
    "huge indent": ("{{ messages | tojson(indent=10**9) }}", "too large"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion too deep"),
    "include": ("{% include 'other.jinja' %}", "cannot include or import"),
    "import": ("{% import 'other.jinja' as o %}{{ o.x }}", "cannot include or import"),
    "doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "more than",
    ),
    "join": ("{{ range(99999) | join('x' * 99999) }}", "joining"),
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_template_is_one_message_naming_it(tmp_path, tokenizer_dir, name):
    template, says = HOSTILE_TEMPLATES[name]
    model = tmp_path / "model"
    model.mkdir()
    for f in tokenizer_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "chat_template.jinja").write_text(template)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    result = run_cli("replay", chats, "--dry-run", "--model", model, "--no-live")
    one_error(result, f"{chats} line 1: chat template of {model / 'chat_template.jinja'}", says)


# -- 6: output paths ---------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.islink("/dev/stdout"), reason="/dev/stdout is no symlink here")
def test_report_to_dev_stdout_leaves_the_symlink(prompts):
    result = run_cli("replay", prompts, "--dry-run", "--report", "/dev/stdout")
    one_error(result, "--report /dev/stdout: it is a symbolic link")
    assert os.path.islink("/dev/stdout")


@pytest.mark.parametrize("flag", ["--report", "--record", "--per-request"])
def test_output_onto_a_fifo_is_refused_without_blocking(prompts, fifo, flag):
    one_error(run_cli("replay", prompts, "--dry-run", flag, fifo), f"{flag} {fifo}: it is a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("flag", ["--report", "--record", "--per-request"])
def test_output_over_the_input_file_is_refused(prompts, flag):
    before = prompts.read_bytes()
    one_error(run_cli("replay", prompts, "--dry-run", flag, prompts), "an input of this run")
    assert prompts.read_bytes() == before


def test_record_through_a_symlink_leaves_its_target(prompts, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "run.trace"
    link.symlink_to(target)
    one_error(run_cli("replay", prompts, "--dry-run", "--record", link), "it is a symbolic link")
    assert target.read_text() == "keep me" and link.is_symlink()


def test_two_outputs_on_one_file_are_refused(prompts, tmp_path):
    out = tmp_path / "out.json"
    result = run_cli("replay", prompts, "--dry-run", "--report", out, "--record", out)
    one_error(result, "that is the --report file too")


def test_report_keeps_an_existing_files_permissions(prompts, tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{}")
    report.chmod(0o600)
    result = run_cli("replay", prompts, "--dry-run", "--report", report, "--no-live")
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    assert json.loads(report.read_text())["requests"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_report_into_a_missing_folder_fails_before_the_run(prompts, tmp_path):
    # Given relative: the message names the path as the user wrote it, not a temp file.
    result = run_cli(
        "replay", prompts, "--dry-run", "--report", "no/such/report.json", cwd=tmp_path
    )
    msg = one_error(result, "--report no/such/report.json: the folder no/such does not exist")
    assert ".tmp" not in msg and result.stdout == ""  # nothing ran


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_report_into_a_read_only_folder_fails_before_the_run(prompts, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        result = run_cli("replay", prompts, "--dry-run", "--report", folder / "r.json")
    finally:
        folder.chmod(0o700)
    one_error(result, f"--report {folder / 'r.json'}")
    assert result.stdout == ""


def test_report_into_a_folder_no_one_can_write_fails_before_the_run(prompts):
    # /proc takes no new files, even from root.
    result = run_cli("replay", prompts, "--dry-run", "--report", "/proc/nanokv-report.json")
    one_error(result, "cannot write --report /proc/nanokv-report.json")
    assert result.stdout == ""


def test_export_onto_a_fifo_or_the_trace_is_refused(prompts, tmp_path, fifo):
    trace = tmp_path / "run.trace"
    assert run_cli("replay", prompts, "--dry-run", "--record", trace).returncode == 0
    one_error(run_cli("inspect", trace, "--export", "jsonl", fifo), "it is a FIFO")
    one_error(run_cli("inspect", trace, "--export", "jsonl", trace), "an input of this run")


def test_reports_hold_no_non_finite_numbers(prompts, tmp_path):
    text = json_text({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": (1.5,)})
    assert json.loads(text) == {"a": None, "b": [None, None], "c": [1.5]}
    # An absurd rate makes absurd (but finite, JSON-valid) times.
    report = tmp_path / "r.json"
    result = run_cli(
        "replay", prompts, "--dry-run", "--rate", "1e-300", "--json", "--report", report
    )
    assert result.returncode == 0, result.stderr

    def refuse(constant: str):
        raise ValueError(constant)

    for text in (result.stdout, report.read_text()):
        json.loads(text, parse_constant=refuse)


# -- 7: huge or endless inputs -----------------------------------------------------------------


def test_a_200_mb_prompt_line_is_refused_by_line(tmp_path):
    path = tmp_path / "huge.txt"
    with open(path, "w") as f:
        f.write("a short prompt\n")
        for _ in range(200):
            f.write("x" * (1 << 20))
        f.write("\n")
    one_error(run_cli("replay", path, "--dry-run"), f"{path} line 2: longer than")


def test_a_prompt_longer_than_the_model_length_is_refused_before_tokenizing(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("a short prompt\n" + "word " * 4000 + "\n")
    result = run_cli("replay", path, "--dry-run", "--max-model-len", "50")
    one_error(result, f"{path} line 2: the text is 20,000 characters, more than 50 tokens")


def test_special_files_are_refused_as_prompt_files(fifo):
    one_error(run_cli("replay", "/dev/zero", "--dry-run"), "/dev/zero: is a character device")
    one_error(run_cli("replay", fifo, "--dry-run"), f"{fifo}: is a FIFO")
    one_error(run_cli("inspect", "--prompts", fifo), f"{fifo}: is a FIFO")


def test_special_files_are_refused_as_model(prompts, fifo):
    one_error(
        run_cli("replay", prompts, "--dry-run", "--model", fifo), f"--model {fifo}: is a FIFO"
    )
    one_error(run_cli("generate", "hi", "--model", fifo), f"--model {fifo}: is a FIFO")


def test_a_directory_is_refused_as_record(prompts, tmp_path):
    one_error(run_cli("replay", prompts, "--dry-run", "--record", tmp_path), "it is a directory")


def test_endless_stdin_is_refused():
    with open("/dev/zero", "rb") as zero:
        result = run_cli("generate", "-", stdin=zero)
    one_error(result, "stdin holds more than", code=2)


def mooncake_line(num_ids: int, first: int = 0) -> str:
    return json.dumps(
        {
            "timestamp": 0,
            "input_length": 512 * num_ids,
            "output_length": 1,
            "hash_ids": list(range(first, first + num_ids)),
        }
    )


def test_a_mooncake_line_of_a_million_hash_ids_is_refused(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(mooncake_line(10**6) + "\n")
    one_error(run_cli("replay", path, "--dry-run"), f"{path} line 1: longer than 1,048,576")


def test_a_huge_mooncake_request_is_rejected_before_its_tokens_are_made(tmp_path):
    # 10**5 ids: a 600 KB line, 51 million tokens (0.8 GB to synthesize) the run cannot admit.
    path = tmp_path / "trace.jsonl"
    path.write_text(mooncake_line(10**5) + "\n" + mooncake_line(1, first=10**6) + "\n")
    result = run_cli("replay", path, "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert "line 1: the prompt (51,200,000 tokens) is longer than the 262,144" in result.stderr
    assert json.loads(result.stdout)["rejected"] == 1


def test_a_dry_run_cache_too_big_for_memory_is_refused(prompts):
    result = run_cli("replay", prompts, "--dry-run", "--num-blocks", "100000000")
    one_error(result, "--num-blocks", "100,000,000 blocks", "lower it", code=2)


# -- 8: values no parser expects ---------------------------------------------------------------

DEEP = "[" * 10**5 + "]" * 10**5


# File name -> its one line, and what the message says. (Parametrized by name: pytest puts the
# test id in the environment, and a 200 KB id makes every subprocess fail to start.)
ODD_VALUES = {
    "big_hash_id.jsonl": (mooncake_line(1).replace("[0]", f"[{2**64}]"), "2**64 - 1"),
    "surrogate.jsonl": ('{"prompt": "ab\\ud800"}', "line 1: 'prompt' holds a lone surrogate"),
    "surrogate_chat.jsonl": (
        '{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "line 1: a message holds a lone surrogate",
    ),
    "deep.jsonl": ('{"prompt": ' + DEEP + "}", "line 1: JSON nested too deeply"),
    "deep.json": (DEEP, "JSON nested too deeply"),
    "deep_mooncake.jsonl": ('{"input_length": 1, "hash_ids": ' + DEEP + "}", "too deeply"),
    "infinite.jsonl": ('{"prompt": "a", "timestamp": Infinity}', "finite number"),
}


@pytest.mark.parametrize("name", ODD_VALUES)
def test_values_no_parser_expects(tmp_path, name):
    text, says = ODD_VALUES[name]
    path = tmp_path / name
    path.write_text(text + "\n")
    one_error(run_cli("replay", path, "--dry-run"), f"{path}", says)


def test_a_lone_surrogate_on_the_command_line_is_one_message():
    # A byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape): refused
    # before the model loads.
    result = run_cli("generate", b"caf\xe9", "--max-tokens", "1")
    one_error(result, "prompt 1 is not UTF-8 text", code=2)


def test_the_tokenizer_refuses_what_would_crash_it(tokenizer_dir):
    from nanokv_cli.engine.model.tokenizer import Tokenizer, TokenizerError

    tokenizer = Tokenizer.from_hf_folder(tokenizer_dir)
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tokenizer.encode("ab\ud800")  # the Rust side raises TypeError
    limit = 10 * tokenizer.max_bytes_per_token
    assert tokenizer.encode("x" * limit, max_tokens=10)  # exactly at the bound: tokenized
    with pytest.raises(TokenizerError, match="more than 10 tokens can hold"):
        tokenizer.encode("x" * (limit + 1), max_tokens=10)
    with pytest.raises(TokenizerError, match="more than 10 tokens can hold"):
        tokenizer.encode("é" * (limit // 2 + 1), max_tokens=10)  # bytes, not characters


# -- hypothesis: malformed prompt files and damaged traces -------------------------------------

NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
TEXT = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "🙂" * 5, ""]),
)
LEAF = st.one_of(NUMBERS, TEXT)
VALUES = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "prompt",
        "messages",
        "prompt_token_ids",
        "timestamp",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "ignore_eos",
        "input_length",
        "output_length",
        "hash_ids",
        "role",
        "content",
    ]
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": TEXT | LEAF, "content": TEXT | LEAF}), max_size=3
)
RECORDS = st.dictionaries(KEYS, VALUES | MESSAGES, max_size=6)
MOONCAKE = st.fixed_dictionaries(
    {
        "timestamp": NUMBERS,
        "input_length": NUMBERS,
        "output_length": NUMBERS,
        "hash_ids": st.lists(NUMBERS, max_size=4) | NUMBERS,
    }
)


def _json_line(obj) -> bytes:
    # Python's json writes NaN, Infinity and lone surrogates (as \\ud800 escapes) on purpose.
    return json.dumps(obj).encode()


# Well-formed lines of each format: a file starts with one (so its format is detected and
# later lines reach the parsers) and mixes them with hostile ones.
GOOD_LINES = {
    "jsonl": st.sampled_from(
        [
            {"prompt": "Tell me about caches", "max_tokens": 3},
            {"messages": [{"role": "user", "content": "hi"}], "timestamp": 1},
            {"prompt_token_ids": [1, 2, 3, 4, 5]},
        ]
    ).map(_json_line),
    "mooncake": st.builds(
        lambda n, t: _json_line(
            {"timestamp": t, "input_length": n, "output_length": 2, "hash_ids": [7] * -(-n // 512)}
        ),
        st.integers(1, 2000),
        st.integers(0, 10**6),
    ),
    "text": st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=30).map(
        lambda t: t.replace("\n", " ").replace("\r", " ").encode()
    ),
}
HOSTILE_LINES = st.one_of(
    RECORDS.map(_json_line),
    MOONCAKE.map(_json_line),
    TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),  # encoded surrogates: bad UTF-8
    st.binary(max_size=30),
    st.integers(1, 10**5).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}"),
    st.sampled_from([b"[", b"{", b'{"prompt": "unterminated', b"\xff\xfe", b"NaN", b"\x00"]),
)


@st.composite
def prompt_files(draw) -> bytes:
    kind = draw(st.sampled_from([*GOOD_LINES, "anything"]))
    good = GOOD_LINES.get(kind, HOSTILE_LINES)
    lines = [draw(good)]
    lines += draw(st.lists(st.one_of(good, HOSTILE_LINES), max_size=5))
    return b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\r\n"]))


SUFFIXES = st.sampled_from([".txt", ".jsonl", ".json"])


def assert_clean(result) -> None:
    """Exit 0, or one message and exit 1 or 2; never an exception out of the command."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("nanokv: error:"), result.stderr
        assert sum(line.startswith("nanokv: error:") for line in lines) == 1


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@settings(
    max_examples=60,
    deadline=10_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=prompt_files(), suffix=SUFFIXES)
def test_malformed_prompt_files_fail_cleanly(tmp_path, tokenizer_dir, data, suffix):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(data)
    before = peak_rss()
    for command in (
        ["replay", path, "--dry-run", "--model", tokenizer_dir, "--json", "--max-tokens", "4"],
        ["inspect", "--prompts", path, "--model", tokenizer_dir, "--json"],
    ):
        assert_clean(runner.invoke(app, [str(a) for a in command]))
    assert peak_rss() - before < 512 << 20


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory, tokenizer_dir) -> bytes:
    folder = tmp_path_factory.mktemp("trace")
    prompts = folder / "p.jsonl"
    shared = "A shared system prompt that spans several blocks of tokens. "
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": shared + q, "timestamp": t})
            for t, q in enumerate(["one?", "two?", "three?"])
        )
    )
    trace = folder / "run.trace"
    result = runner.invoke(
        app,
        [
            "replay",
            str(prompts),
            "--dry-run",
            "--model",
            str(tokenizer_dir),
            "--block-size",
            "8",
            "--num-blocks",
            "64",
            "--record",
            str(trace),
            "--max-tokens",
            "40",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return trace.read_bytes()


DAMAGE = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
)


def damage(data: bytes, how) -> bytes:
    at = int(how[1] * len(data))
    if how[0] == "truncate":
        return data[:at]
    if how[0] == "overwrite":
        return data[:at] + how[2] + data[at + len(how[2]) :]
    return data[:at] + how[2] + data[at:]


@settings(
    max_examples=60,
    deadline=10_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(hows=st.lists(DAMAGE, min_size=1, max_size=3))
def test_damaged_traces_fail_cleanly(tmp_path, small_trace, hows):
    data = small_trace
    for how in hows:
        data = damage(data, how)
    path = tmp_path / "damaged.trace"
    path.write_bytes(data)
    before = peak_rss()
    for extra in ([], ["--step", "3"], ["--summary"], ["--request", "1"], ["--json"]):
        assert_clean(runner.invoke(app, ["inspect", str(path), *extra]))
    assert peak_rss() - before < 512 << 20
