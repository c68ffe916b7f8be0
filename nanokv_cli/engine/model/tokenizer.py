"""Text <-> token ids, chat templates and streaming detokenization.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the fast Rust one) plus what the model
folder says about special tokens and chat formatting. It is built either from a Hugging Face model
folder (`tokenizer.json`, `tokenizer_config.json`) or from GGUF metadata, and saved back in the
Hugging Face layout, so a converted GGUF model's tokenizer loads like any other folder's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from ..runner.memory import release_freed_memory
from .chat_template import TemplateLimits, render_chat_template
from .tokenizer_errors import ChatTemplateError, TokenizerError

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) -> the split regex of the matching
# Hugging Face tokenizer. None means the plain GPT-2 ByteLevel regex.
_GPT2_PATTERN = None
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = "digits+gpt2"  # StarCoder-style: every digit is its own pre-token
_PRE_TOKENIZERS: dict[str, str | None] = {
    "default": _GPT2_PATTERN,
    "gpt2": _GPT2_PATTERN,
    "gpt-2": _GPT2_PATTERN,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_PATTERN,
    "llama3": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "dbrx": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these (as the
# Llama 3 tokenizer.json's `ignore_merges` does), and adds BOS unless the file says otherwise.
_LLAMA3_STYLE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"}

# The longest text tokenized in one call: the Rust tokenizer takes ~130 bytes of memory per
# byte of text (2 GB for this much) and aborts the process when an allocation fails.
MAX_TEXT_BYTES = 1 << 24
# Tokenizing text this long (characters) takes temporaries of hundreds of bytes a character,
# which glibc keeps when a CPU run has pinned its thresholds: handed back after each such text.
LARGE_TEXT = 1 << 16

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Encode/decode text and render chat templates for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_template_name: str = "of the model",
        template_limits: TemplateLimits | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # Where the template came from, for its error messages ("chat template <name>: ...").
        self.chat_template_name = chat_template_name
        self.template_limits = template_limits or TemplateLimits()
        # Template variables such as bos_token/eos_token, as transformers passes them.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})

    # -- encoding -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids of `text`; special-token strings in the text become their ids.

        Text that is not valid Unicode (a lone surrogate, as a JSON escape or an undecodable
        command-line byte makes one) is refused with a TokenizerError, and so is text the Rust
        tokenizer could choke on (it aborts the process when out of memory): over
        `MAX_TEXT_BYTES`, or, with `max_tokens`, more bytes than that many tokens can hold.
        """
        self.check_text(text, max_tokens)
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if len(text) >= LARGE_TEXT:  # a server refusing huge prompts must not grow with each
            release_freed_memory()
        return ids

    @cached_property
    def max_bytes_per_token(self) -> int:
        """A generous bound on the bytes of text one token stands for: the longest token's
        UTF-8. Byte-level vocabularies spell bytes as characters of up to 2 UTF-8 bytes, so this
        is up to twice the truth there, room for normalizers that shorten text (NFC composing a
        letter and its accent)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "replace")) for t in vocab), default=16)

    def check_text(self, text: Any, max_tokens: int | None = None) -> None:
        """Refuse (TokenizerError) what `encode` refuses, without tokenizing."""
        if not isinstance(text, str):
            raise TokenizerError(f"expected text to tokenize, got {type(text).__name__}")
        limit = MAX_TEXT_BYTES
        if max_tokens is not None:
            limit = min(limit, max_tokens * self.max_bytes_per_token)
        if len(text) > limit:  # every character is at least one byte
            self._too_long(len(text), "characters", max_tokens, limit)
        if text.isascii():
            return
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"the text holds a lone surrogate ({text[e.start]!r}) at character {e.start}: "
                "not valid Unicode"
            ) from None
        if size > limit:
            self._too_long(size, "bytes", max_tokens, limit)

    def _too_long(self, size: int, unit: str, max_tokens: int | None, limit: int) -> None:
        if max_tokens is not None and limit < MAX_TEXT_BYTES:
            raise TokenizerError(
                f"the text is {size:,} {unit}, more than {max_tokens:,} tokens can hold "
                f"(at most {self.max_bytes_per_token} bytes each)"
            )
        raise TokenizerError(
            f"the text is {size:,} {unit}; nanokv tokenizes at most {MAX_TEXT_BYTES:,} bytes "
            "at once"
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template, as transformers would."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass a plain prompt instead")
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        context.update(template_kwargs)
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        return render_chat_template(
            self.chat_template, self.chat_template_name, context, self.template_limits
        )

    # -- persistence ------------------------------------------------------------------------

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (Hugging Face layout) into `folder`."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json + tokenizer_config.json)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json (nanokv needs a fast tokenizer)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise TokenizerError(f"{path} is not a valid tokenizer file: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(key))) is not None
        }
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if config.get("add_bos_token") and bos_id is not None:
            _ensure_bos(backend, special["bos_token"], bos_id)
        template, template_file = _hf_chat_template(folder, config)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[] if eos_id is None else [eos_id],
            chat_template=template,
            special_tokens=special,
            chat_template_name=f"of {template_file}",
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF key/value metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's Hugging Face folder instead"
            )
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens list")
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], pre)
        _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id = token_id("bos_token_id")
        special = {"bos_token": tokens[bos_id]} if bos_id is not None else {}
        eos_ids = [
            i
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (i := token_id(key)) is not None
        ]
        if eos_ids:
            special["eos_token"] = tokens[eos_ids[0]]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_STYLE)
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _special_token_template(
            (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None,
            (tokens[eos_ids[0]], eos_ids[0]) if add_eos and eos_ids else None,
        )
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
            chat_template_name="in the GGUF metadata (tokenizer.chat_template)",
        )


class IncrementalDecoder:
    """Turn a stream of token ids into text pieces, one `add` per token.

    Byte-level tokens may end in the middle of a UTF-8 character; such text is held back until the
    character is complete, so the pieces never contain a U+FFFD that the full decode would not.
    Each call decodes only the tokens since the last emitted piece (plus one piece of context),
    so the cost per token does not grow with the length of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # The text of token_ids[prefix_offset:read_offset] was already emitted; decoding from
        # prefix_offset keeps the context a tokenizer needs to place spaces correctly.
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.token_ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an unfinished character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        window = self.token_ids[self.prefix_offset :]
        seen = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        text = decode(window, self.skip_special_tokens)
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(seen) :]


# -- building blocks ---------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges: Iterable[str], pre: str) -> BackendTokenizer:
    vocab = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # llama.cpp resolves duplicate strings to the first id
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_STYLE)
    backend = BackendTokenizer(model)
    pattern = _PRE_TOKENIZERS.get(pre, _GPT2_PATTERN)
    # ByteLevel applies GPT-2's regex itself unless a custom Split already did the splitting.
    gpt2_regex = pattern in (_GPT2_PATTERN, _DIGITS_THEN_GPT2)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)
    if pattern == _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pattern is not None:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    if pattern == _QWEN2_PATTERN:
        backend.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json does
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens are special (skipped when decoding with skip_special_tokens); user-defined
    # ones (e.g. Qwen3's <think>) are matched whole in the input but kept in decoded text.
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _special_token_template(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor:
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    first = f"{bos[0]} " if bos else ""
    last = f" {eos[0]}" if eos else ""
    return processors.TemplateProcessing(
        single=f"{first}$A{last}",
        pair=f"{first}$A{last} {first}$B:1{last}",
        special_tokens=[t for t in (bos, eos) if t is not None],
    )


def _ensure_bos(backend: BackendTokenizer, bos: str, bos_id: int) -> None:
    # tokenizer_config says to add BOS; older Llama folders rely on the tokenizer class for it
    # rather than on tokenizer.json's post-processor, so add it there when it is missing.
    if backend.encode("a", add_special_tokens=True).ids[:1] != [bos_id]:
        backend.post_processor = _special_token_template((bos, bos_id), None)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, Path]:
    """The folder's chat template and the file it came from."""
    # transformers >= 4.43 saves the template as chat_template.jinja next to the config.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), jinja_file
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_file} cannot be read: {exc}") from None
    source = folder / "tokenizer_config.json"
    template = config.get("chat_template")
    if not template:
        source = folder / "chat_template.json"
        template = _read_json(source).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template if isinstance(template, str) else None), source


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc or type(exc).__name__}") from exc
    return data if isinstance(data, dict) else {}
