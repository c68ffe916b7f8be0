"""Prompt-file readers: every format, format detection, and errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.workload.prompts import (
    PromptFileError,
    detect_format,
    map_prompt_blocks,
    read_prompts,
)

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO / "examples" / "traces" / "mooncake_conversation_trace.jsonl"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_plain_text_one_prompt_per_line_skipping_blank_lines(tmp_path):
    path = write(tmp_path, "p.txt", "Hello there\n\n  indented {not json}\r\nlast")
    pf = read_prompts(path)
    assert pf.format == "text"
    assert [r.prompt for r in pf.requests] == ["Hello there", "  indented {not json}", "last"]
    assert [r.line for r in pf.requests] == [1, 3, 4]


def test_jsonl_prompt_messages_and_token_ids_with_sampling_fields(tmp_path):
    lines = [
        {"prompt": "a", "temperature": 0.7, "max_tokens": 5, "seed": 1},
        {"messages": [{"role": "user", "content": "hi"}], "top_p": 0.9, "top_k": 3},
        {"prompt_token_ids": [1, 2, 3], "ignore_eos": True, "timestamp": 2.5},
    ]
    path = write(tmp_path, "p.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    pf = read_prompts(path)
    assert pf.format == "jsonl"
    a, b, c = pf.requests
    assert a.prompt == "a" and a.sampling == {"temperature": 0.7, "max_tokens": 5, "seed": 1}
    assert b.messages == [{"role": "user", "content": "hi"}]
    assert c.prompt_token_ids == [1, 2, 3] and c.timestamp == 2.5
    assert pf.has_timestamps
    sp = a.sampling_params(SamplingParams(temperature=0.0, max_tokens=64, top_k=9))
    assert (sp.temperature, sp.max_tokens, sp.seed, sp.top_k) == (0.7, 5, 1, 9)


def test_sharegpt_takes_the_chat_up_to_the_first_assistant_reply(tmp_path):
    data = [
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "What is a KV cache?"},
                {"from": "gpt", "value": "Keys and values."},
                {"from": "human", "value": "And paging?"},
            ],
        },
        {"id": "only-bot", "conversations": [{"from": "gpt", "value": "hello"}]},
        {"prompt": "records work in an array too"},
    ]
    path = write(tmp_path, "sg.json", json.dumps(data, indent=2))
    pf = read_prompts(path)
    assert pf.format == "sharegpt"
    assert len(pf.requests) == 2  # the conversation without a user turn is skipped
    assert pf.requests[0].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    assert pf.requests[1].prompt == "records work in an array too"


def test_mooncake_trace_detected_and_read_lazily_with_output_lengths():
    pf = read_prompts(MOONCAKE, limit=3)
    assert pf.format == "mooncake" and len(pf.requests) == 3
    first = pf.requests[0]
    assert first.sampling == {"max_tokens": 500, "ignore_eos": True}
    assert first.timestamp == 0.0 and first.num_prompt_tokens == 6758
    tokens = first.token_source()
    assert len(tokens) == 6758
    # hash id 0 opens the first three requests: their first 512 tokens are equal.
    assert list(pf.requests[1].token_source()[:512]) == list(tokens[:512])


@pytest.mark.parametrize(
    "name, text, fmt",
    [
        ("a.txt", "hello\n", "text"),
        ("a", '{"prompt": "x"}\n', "jsonl"),
        (
            "a.data",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
            "mooncake",
        ),
        ("a", '[{"conversations": []}]', "sharegpt"),
        ("a.json", '[\n  {"prompt": "x"}\n]\n', "sharegpt"),
    ],
)
def test_detect_format_from_content(tmp_path, name, text, fmt):
    assert detect_format(write(tmp_path, name, text)) == fmt


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', "line 2: not valid JSON"),
        ('{"prompt": "a"}\n\n[1, 2]\n', "line 3: expected a JSON object"),
        ('{"prompt": "a"}\n{"prompt": 3}\n', "line 2: 'prompt' must be a string"),
        ('{"prompt": "a"}\n{"prompt": "a", "messages": []}\n', "line 2: expected exactly one of"),
        ('{"prompt": "a"}\n{"messages": [{"role": "user"}]}\n', "line 2: 'messages' must be"),
        ('{"prompt": "a"}\n{"prompt_token_ids": [1, -2]}\n', "line 2: 'prompt_token_ids' must be"),
        (
            '{"prompt": "a"}\n{"prompt": "b", "temperature": -1}\n',
            "line 2: temperature must be >= 0",
        ),
        ('{"prompt": "a"}\n{"prompt": "b", "max_tokens": 0}\n', "line 2: max_tokens must be"),
        ('{"prompt": "a"}\n{"prompt": "b", "top_p": "x"}\n', "line 2: top_p must be a number"),
        ('{"prompt": "a", "ignore_eos": 1}\n', "line 1: ignore_eos must be a boolean"),
        ('{"prompt": "a"}\n{"prompt": "b", "timestamp": -1}\n', "line 2: 'timestamp' must be"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, text, message):
    path = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(PromptFileError, match=message.replace("(", r"\(")) as info:
        read_prompts(path)
    assert str(path) in str(info.value)


def test_malformed_mooncake_line_names_the_line(tmp_path):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    bad = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}'
    path = write(tmp_path, "t.jsonl", f"{good}\n{good}\n{bad}\n")
    with pytest.raises(PromptFileError, match="line 3: 1 hash_ids do not cover"):
        read_prompts(path)
    assert len(read_prompts(path, limit=2).requests) == 2  # --limit stops before the bad line


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"foo": 1}\n', "unknown format: line 1 is a JSON object without"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "unknown format: not UTF-8"),
        (b'{"a": 1}', "unknown format"),
        (b'{"conversations": []}', "unknown format"),
        (b"", "the file is empty"),
        (b"\n\n  \n", "the file is empty"),
    ],
)
def test_unknown_or_empty_files(tmp_path, content, message):
    path = tmp_path / "f.bin"
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=message):
        read_prompts(path)


def test_json_object_file_is_an_unknown_format(tmp_path):
    path = write(tmp_path, "x.json", '{\n  "conversations": []\n}\n')
    with pytest.raises(PromptFileError, match="unknown format: a JSON file must hold an array"):
        read_prompts(path)


def test_missing_file_and_directory_and_bad_format_name(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        read_prompts(tmp_path / "nope.txt")
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(tmp_path)
    with pytest.raises(PromptFileError, match="unknown format 'csv'"):
        read_prompts(write(tmp_path, "a.txt", "x"), fmt="csv")


def test_forced_format_overrides_detection(tmp_path):
    path = write(tmp_path, "a.txt", '{"prompt": "x"}\n')
    assert read_prompts(path, fmt="text").requests[0].prompt == '{"prompt": "x"}'


def test_limit_keeps_the_first_requests(tmp_path):
    path = write(tmp_path, "a.txt", "".join(f"p{i}\n" for i in range(10)))
    assert [r.prompt for r in read_prompts(path, limit=3).requests] == ["p0", "p1", "p2"]


def test_prompt_block_map_shares_equal_prefixes_only():
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 4, 9, 9, 9, 9, 9]
    c = [0, 2, 3, 4]  # same second block, different first: no sharing (chained hashes)
    info = map_prompt_blocks([a, b, c], block_size=2)
    pa, pb, pc = info["prompts"]
    assert [blk["num_tokens"] for blk in pa["blocks"]] == [2, 2, 2, 1]
    assert pa["blocks"][0]["hash"] == pb["blocks"][0]["hash"] != pc["blocks"][0]["hash"]
    assert pc["blocks"][1]["hash"] != pa["blocks"][1]["hash"]
    assert [blk["shared_by"] for blk in pb["blocks"][:3]] == [2, 2, 1]
    assert [blk["hit"] for blk in pb["blocks"][:4]] == [True, True, False, False]
    assert info["hit_tokens"] == 4 and info["prompt_tokens"] == 20
    assert info["shared_full_blocks"] == 2 and info["unique_full_blocks"] == 7
