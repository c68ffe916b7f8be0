"""Chat templates: a model's Jinja template, rendered in a sandbox under time and size limits.

A chat template ships with the model's files, so it is untrusted code. It runs in Jinja's
immutable sandbox (no interpreter internals, no mutation of the messages), and every render is
bounded, so a hostile or broken template costs at most a few seconds and a few megabytes:

* time: a trace function checks a deadline at every line the render runs (template loops,
  macro recursion and the filters they call);
* size: every value the template makes with an operator, a filter or a call is measured; one
  larger than the output limit, or more than ``VALUE_BUDGET`` outputs' worth in all, stops the
  render. Operations that would build a huge value in one go (``'x' * 10**9``,
  ``|center(10**9)``, ``|join`` of a long list, ``'{:>999999}'.format(x)``) are refused before
  they run, and the text is capped as it streams out.

Whatever goes wrong (syntax, ``raise_exception``, a sandbox refusal, a limit, a Python error such
as RecursionError) is one ``ChatTemplateError`` naming the template.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer_errors import ChatTemplateError

# Every value a render makes may add up to this many outputs' worth of characters (garbage
# included): templates that build their text piecewise stay far below it.
VALUE_BUDGET = 16
_MAX_INT_BITS = 1 << 16  # `**` results: plenty for arithmetic, refuses 10**10**9
_MAX_JSON_INDENT = 64


@dataclass(frozen=True)
class TemplateLimits:
    """How long a render may take and how much it may write: ``max_chars`` plus ``per_input``
    characters per character of the messages (a template writes each message once or twice)."""

    seconds: float = 2.0
    max_chars: int = 1 << 20
    per_input: int = 4

    def output_limit(self, input_chars: int) -> int:
        return self.max_chars + self.per_input * input_chars


class TemplateLimitError(jinja2.TemplateError):
    """A render went over a limit (raised inside the render, reported as ChatTemplateError)."""


class _Deadline(BaseException):
    # A BaseException, so no `except Exception` on the way out can swallow it.
    pass


def render_chat_template(
    source: str, name: str, context: Mapping[str, Any], limits: TemplateLimits
) -> str:
    """``source`` rendered with ``context``; ``name`` says which template in error messages."""
    max_chars = limits.output_limit(_input_chars(context.get("messages")))
    try:
        env = _environment()
        template = _compile(source)
        env.start(max_chars)
        return _render_bounded(env, template, dict(context), max_chars, limits.seconds)
    except ChatTemplateError:
        raise
    except _Deadline:
        raise ChatTemplateError(
            f"chat template {name}: rendering took longer than {limits.seconds:g} s "
            "(an endless or huge loop?)"
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template {name} does not parse: {exc}") from None
    except RecursionError:
        raise ChatTemplateError(f"chat template {name}: recursion too deep") from None
    except MemoryError:
        raise ChatTemplateError(f"chat template {name}: out of memory while rendering") from None
    except Exception as exc:  # the template is untrusted code: any failure is the template's
        where = _template_line(exc)
        raise ChatTemplateError(f"chat template {name}{where}: {_describe(exc)}") from None


def _render_bounded(
    env: _BoundedSandbox, template: jinja2.Template, context: dict, max_chars: int, seconds: float
) -> str:
    deadline = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Deadline
        return trace

    previous = sys.gettrace()  # a debugger's or coverage's tracer comes back afterwards
    pieces: list[str] = []
    written = 0
    sys.settrace(trace)
    try:
        for piece in template.generate(**context):
            written += len(piece)
            if written > max_chars:
                raise TemplateLimitError(
                    f"the rendered text is longer than {max_chars:,} characters"
                )
            pieces.append(piece)
    finally:
        sys.settrace(previous)
        env.stop()
    return "".join(pieces)


def _input_chars(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    return sum(
        len(v) for m in messages if isinstance(m, Mapping) for v in m.values() if isinstance(v, str)
    )


def _template_line(exc: BaseException) -> str:
    # Jinja rewrites tracebacks so template code shows under the template's own line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" line {line}" if line else ""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, jinja2.TemplateError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- the environment -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedSandbox:
    # One environment for every template: its render state is per thread (see start/stop).
    return _BoundedSandbox()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


class _RenderState:
    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.budget = VALUE_BUDGET * max_chars


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every value a template makes measured (see the module
    docstring), the helpers Hugging Face templates use, and no loader (no include/import)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
            loader=_NoTemplates(),
        )
        self._local = threading.local()
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(f) for name, f in self.filters.items()}
        env = self

        class Namespace(_TemplateNamespace):
            @staticmethod
            def _count(value: Any) -> Any:
                return env.count(value)

        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["namespace"] = Namespace

    # -- per-render state

    def start(self, max_chars: int) -> None:
        self._local.state = _RenderState(max_chars)

    def stop(self) -> None:
        self._local.state = None

    @property
    def _state(self) -> _RenderState:
        state = getattr(self._local, "state", None)
        if state is None:  # rendered without render_chat_template: use the default limits
            state = self._local.state = _RenderState(TemplateLimits().max_chars)
        return state

    def count(self, value: Any) -> Any:
        """Charge a value the template made to the render's budget; refuse one too large."""
        state = self._state
        size = _size(value, state.max_chars + 1)
        if size > state.max_chars:
            raise TemplateLimitError(
                f"a value of more than {state.max_chars:,} characters (the output limit)"
            )
        state.budget -= size
        if state.budget < 0:
            raise TemplateLimitError(
                f"the template made more than {VALUE_BUDGET} times the output limit in values"
            )
        return value

    def refuse_over(self, estimate: int, what: str) -> None:
        if estimate > self._state.max_chars:
            raise TemplateLimitError(
                f"{what} would make about {estimate:,} characters (the limit is "
                f"{self._state.max_chars:,})"
            )

    def _check_numbers(self, values: Any) -> None:
        # Numbers given to filters and methods are widths, counts and indents: one above the
        # output limit can only make an oversized value.
        limit = self._state.max_chars
        for v in values:
            if type(v) is int and abs(v) > limit:
                raise TemplateLimitError(f"the number {v} is too large for a chat template")

    # -- operators, calls, filters

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and type(n) is int:
                    self.refuse_over(_size(seq, 1 << 62) * max(n, 0), "repeating a value")
        elif operator == "**" and type(left) is int and type(right) is int:
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_INT_BITS:
                raise TemplateLimitError(f"{left} ** {right} is too large for a chat template")
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            self._check_format(left, args)
        return self.count(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._check_numbers(args)
        __self._check_numbers(kwargs.values())
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = __self._check_str_method(owner, __obj.__name__, args)
        return __self.count(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            self._check_format(fmt, (*args, *kwargs.values()))
            return self.count(wrapper(*args, **kwargs))

        return checked

    def _check_format(self, fmt: str, args: Any) -> None:
        # A crude upper bound: every field may hold the largest argument, and every number in
        # the format string may be a width.
        args = list(args.values()) if isinstance(args, Mapping) else list(args)
        largest = max((_size(a, 1 << 62) for a in args), default=0)
        fields = fmt.count("{") + fmt.count("%")
        widths = sum(int(n) for n in re.findall(r"\d+", fmt))
        self.refuse_over(len(fmt) + fields * (largest + 32) + widths, "formatting")

    def _check_str_method(self, s: str, name: str, args: tuple) -> tuple:
        if name == "join" and args:
            items = list(args[0])
            self.refuse_over(_join_size(items, len(s)), "joining")
            return (items, *args[1:])
        if name == "replace" and len(args) >= 2:
            self.refuse_over(_replace_size(s, *args[:3]), "replacing")
        elif name == "expandtabs":
            width = args[0] if args and type(args[0]) is int else 8
            self.refuse_over(len(s) + s.count("\t") * width, "expanding tabs")
        elif name == "translate":
            table = args[0] if args else {}
            longest = max(
                (len(v) for v in getattr(table, "values", lambda: ())() if isinstance(v, str)),
                default=1,
            )
            self.refuse_over(len(s) * longest, "translating")
        return args

    def _bounded_filter(self, f: Any) -> Any:
        first = 1 if jinja2.utils._PassArg.from_obj(f) is not None else 0
        checks = {"join": self._join_filter_args, "replace": self._replace_filter_args}
        check = checks.get(getattr(f, "__name__", "").removeprefix("do_"))
        indent = getattr(f, "__name__", "") == "do_indent"

        @functools.wraps(f)  # keeps the pass_context / pass_eval_context marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_numbers(args[first + 1 :])
            self._check_numbers(kwargs.values())
            if check is not None:
                args = check(args, first, kwargs)
            elif indent:
                self._check_indent(args[first:], kwargs)
            return self.count(f(*args, **kwargs))

        return bounded

    def _join_filter_args(self, args: tuple, first: int, kwargs: dict) -> tuple:
        items = list(args[first])
        rest = args[first + 1 :]
        sep = rest[0] if rest else kwargs.get("d", "")
        self.refuse_over(_join_size(items, len(str(sep))), "joining")
        return (*args[:first], items, *rest)

    def _replace_filter_args(self, args: tuple, first: int, kwargs: dict) -> tuple:
        s, *rest = args[first:]
        old = rest[0] if rest else kwargs.get("old", "")
        new = rest[1] if len(rest) > 1 else kwargs.get("new", "")
        count = rest[2] if len(rest) > 2 else kwargs.get("count")
        self.refuse_over(_replace_size(str(s), str(old), str(new), count), "replacing")
        return args

    def _check_indent(self, args: tuple, kwargs: dict) -> None:
        s = str(args[0]) if args else ""
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if type(width) is int else 4
        self.refuse_over(len(s) + (s.count("\n") + 1) * pad, "indenting")


class _NoTemplates(jinja2.BaseLoader):
    def get_source(self, environment: Any, template: str) -> Any:
        raise jinja2.TemplateNotFound(
            f"{template!r}: a chat template cannot include or import other templates"
        )


def _size(value: Any, stop: int, depth: int = 0) -> int:
    """About how many characters ``value`` takes written out (shared parts counted each
    time), counting no further than ``stop``."""
    if isinstance(value, str | bytes):
        return len(value)
    if type(value) is int:
        return value.bit_length() // 3
    if depth >= 8 or not isinstance(value, list | tuple | dict | set | frozenset):
        return 1
    items = value.items() if isinstance(value, dict) else value
    total = len(value)
    for item in items:
        total += _size(item, stop - total, depth + 1)
        if total > stop:
            break
    return total


def _join_size(items: list, sep: int) -> int:
    return sum(_size(i, 1 << 62) for i in items) + sep * max(len(items) - 1, 0)


def _replace_size(s: str, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    n = s.count(old) if old else len(s) + 1
    if type(count) is int and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


# -- helpers Hugging Face templates use -------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used for assistant masks) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Templates are untrusted: refuse dunder-ish names that could reach interpreter internals,
    # and measure what is stored (a namespace is how a template grows a value across a loop).
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check_name(name)
            type(self)._count(value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)  # Namespace hides attribute lookups on self
        type(self)._count(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _count(value: Any) -> Any:
        return value

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    width = len(indent) if isinstance(indent, str) else indent
    if width is not None and (type(width) is not int or width > _MAX_JSON_INDENT):
        raise TemplateLimitError(f"tojson: indent must be at most {_MAX_JSON_INDENT}")
    if separators is not None and sum(len(str(s)) for s in separators) > _MAX_JSON_INDENT:
        raise TemplateLimitError(f"tojson: separators must be at most {_MAX_JSON_INDENT} long")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
