"""Tokenizer: the default model's GGUF tokenizer, HF folders, chat templates, streaming decode."""

import json

import pytest
from support.models import CHATML_TEMPLATE, make_tokenizer_files
from tokenizers import pre_tokenizers

from nanokv_cli.engine.model.gguf_file import gguf_metadata
from nanokv_cli.engine.model.loader import default_model_path
from nanokv_cli.engine.model.tokenizer import (
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
)

SAMPLES = [
    "The capital of France is",
    "Crème brûlée, naïve café — déjà vu.",
    "Emoji 🙂🚀 and a family 👩‍👩‍👧, 日本語のテキスト, Ελληνικά.",
    "def add(a, b):\n    return a + b\n\n\n",
    "In 2024 we had 12345 tokens;   three spaces\tand a tab.",
    "<|im_start|>user\nHello<|im_end|>\n",
]


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf_metadata(gguf_metadata(default_model_path()))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tokenizer_files(tmp_path_factory.mktemp("tok"))


# -- the default model (SmolLM2, byte-level BPE from GGUF metadata) ------------------------------


def test_default_tokenizer_known_ids(smol):
    ids = smol.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]
    assert [smol.id_to_token(i) for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    assert smol.token_to_id("<|endoftext|>") == 0
    assert smol.token_to_id("<|im_start|>") == 1
    assert smol.token_to_id("<|im_end|>") == 2
    assert smol.vocab_size == 49152
    assert smol.eos_token_ids == [2]
    assert smol.bos_token_id == 1
    assert smol.encode("Hi", add_special_tokens=True) == smol.encode("Hi", add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_default_tokenizer_round_trips(smol, text):
    assert smol.decode(smol.encode(text), skip_special_tokens=False) == text


def test_default_tokenizer_splits_digits_one_by_one(smol):
    ids = smol.encode("2024")
    assert [smol.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_in_text_become_ids(smol):
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nHi"


def test_default_chat_template_is_chatml(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert smol.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = smol.apply_chat_template(with_system, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


# -- Hugging Face folders ------------------------------------------------------------------------


def test_hf_folder_matches_transformers(tiny_folder):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_folder(tiny_folder)
    theirs = AutoTokenizer.from_pretrained(tiny_folder)
    for text in SAMPLES:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token_ids == [2] and ours.bos_token_id == 1


def test_save_and_reload_keeps_behaviour(smol, tmp_path):
    smol.save(tmp_path)
    again = Tokenizer.from_hf_folder(tmp_path)
    for text in SAMPLES:
        assert again.encode(text) == smol.encode(text), text
    assert again.chat_template == smol.chat_template
    assert (again.bos_token_id, again.eos_token_ids) == (smol.bos_token_id, smol.eos_token_ids)


def test_add_bos_token_from_tokenizer_config(tiny_folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.encode("hello")[0] == 1
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != 1


def test_chat_template_file_and_named_templates(tiny_folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_folder / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "plain"
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "from the file"


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_malformed_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match="not a valid tokenizer file"):
        Tokenizer.from_hf_folder(tmp_path)


# -- GGUF pre-tokenizers -------------------------------------------------------------------------


def byte_level_meta(pre: str, **extra) -> dict:
    """GGUF tokenizer metadata with only the 256 byte tokens and two control tokens."""
    tokens = ["<s>", "</s>", *pre_tokenizers.ByteLevel.alphabet()]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def pre_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]


def test_llama3_pre_tokenizer_groups_digits_by_three_and_adds_bos():
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_meta("llama-bpe"))
    assert pre_tokens(tokenizer, "1234567") == ["123", "456", "7"]
    assert tokenizer.encode("hi")[0] == 0  # llama.cpp adds BOS for llama-bpe by default
    no_bos = Tokenizer.from_gguf_metadata(
        byte_level_meta("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    )
    assert no_bos.encode("hi")[0] != 0


def test_qwen2_pre_tokenizer_splits_digits_and_normalizes_nfc():
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_meta("qwen2"))
    assert pre_tokens(tokenizer, "x 123") == ["x", "Ġ", "1", "2", "3"]
    assert tokenizer.encode("e\u0301") == tokenizer.encode("\u00e9")


def test_smollm_pre_tokenizer_matches_the_hf_one(tiny_folder):
    from_gguf = Tokenizer.from_gguf_metadata(byte_level_meta("smollm"))
    from_hf = Tokenizer.from_hf_folder(tiny_folder)
    for text in SAMPLES:
        assert pre_tokens(from_gguf, text) == pre_tokens(from_hf, text), text


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf_metadata(
            byte_level_meta("default", **{"tokenizer.ggml.model": "llama"})
        )


# -- streaming decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decode_equals_full_decode(smol, text):
    ids = smol.encode(text)
    decoder = IncrementalDecoder(smol)
    pieces = [decoder.add(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == smol.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_decode_holds_back_split_characters(smol):
    ids = smol.encode("a🙂b")
    decoder = IncrementalDecoder(smol)
    pieces = [decoder.add(i) for i in ids]
    assert "".join(pieces) == "a🙂b"
    assert "" in pieces  # some token ended inside the emoji's four bytes and emitted nothing


def test_incremental_decode_flushes_an_unfinished_character(tiny_folder):
    tokenizer = Tokenizer.from_hf_folder(tiny_folder)
    ids = tokenizer.encode("ok 🚀")
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids[:-1]]  # stop one byte short of the rocket
    assert "".join(pieces) == "ok "
    assert decoder.flush() == "\ufffd"


def test_incremental_decode_keeps_special_tokens_when_asked(smol):
    ids = smol.encode("<|im_start|>assistant\nSalut, ça va? 😀<|im_end|>")
    for skip in (True, False):
        decoder = IncrementalDecoder(smol, skip_special_tokens=skip)
        text = "".join(decoder.add(i) for i in ids) + decoder.flush()
        assert text == smol.decode(ids, skip_special_tokens=skip)


# -- chat template sandbox -----------------------------------------------------------------------


def with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        chat_template=template,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )


def test_chat_template_helpers(smol):
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "|{{ ns.n }}|{{ strftime_now('%Y') | length }}|{{ enable_thinking }}"
    )
    messages = [{"role": "user", "content": "café <b>"}] * 3
    rendered = with_template(smol, template).apply_chat_template(messages, enable_thinking=False)
    message_json = '{"role": "user", "content": "café <b>"}'
    assert rendered == f"<s>{message_json}{message_json}|3|4|False"


def test_chat_template_raise_exception(smol):
    tokenizer = with_template(smol, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.append({'role': 'x'}) }}",
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace(__init__=1) %}",
    ],
)
def test_chat_template_is_sandboxed(smol, template):
    with pytest.raises(ChatTemplateError):
        with_template(smol, template).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template(smol):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        with_template(smol, None).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_syntax_error(smol):
    with pytest.raises(ChatTemplateError, match="does not parse"):
        with_template(smol, "{% for %}").apply_chat_template([])


def test_chatml_template_in_tiny_folder(tiny_folder):
    tokenizer = Tokenizer.from_hf_folder(tiny_folder)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
