"""A request's JSON body, read within bounds: too large a body gets a 413 and too deep a one a
400 before either is parsed (Python's json and pydantic recurse per level)."""

from __future__ import annotations

import itertools
import json
import logging
import re
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from .protocol import ApiError, ClientGone

MAX_BODY_BYTES = 1 << 20  # larger bodies get a 413
_DRAIN_BODY_BYTES = 16 << 20  # read (and drop) this much of a too-large body before the 413
# Deeper bodies get a 400 before they are parsed; an OpenAI request nests about 5 deep.
MAX_JSON_DEPTH = 64

_log = logging.getLogger("uvicorn.error")  # uvicorn's handlers: the server's log, its format


async def read_json_body(request: HttpRequest) -> dict[str, Any]:
    await _check_json_type(request)
    too_large = ApiError(
        413, f"the request body is larger than {MAX_BODY_BYTES:,} bytes", code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        await _drain(request)
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _drain(request, size)
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        _log_gone_mid_body(request, size, length)
        raise ClientGone() from None
    raw = b"".join(chunks)
    if _nesting_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def _check_json_type(request: HttpRequest) -> None:
    """A body is JSON only if it says so (``application/json`` or ``*/*+json``), as FastAPI
    requires. A browser sends ``text/plain``, a form or no type at all cross-site without a
    preflight, so reading those as JSON would let any web page run generations here."""
    kind = request.headers.get("content-type", "")
    media = kind.partition(";")[0].strip().lower()
    main, _, sub = media.partition("/")
    if main == "application" and (sub == "json" or sub.endswith("+json")):
        return
    await _drain(request)  # so the client reads the answer
    raise ApiError(
        415,
        f"the body must be JSON sent with 'Content-Type: application/json', "
        f"not {'no Content-Type' if not kind else repr(kind[:100])}",
        code="unsupported_media_type",
    )


def _log_gone_mid_body(request: HttpRequest, size: int, length: str | None) -> None:
    """One line, not a traceback: a client that leaves mid-body is routine, not a bug."""
    client = request.client
    who = f"{client.host}:{client.port}" if client else "a client"
    timeout = request.scope.get("nanokv.body_timeout")
    why = f"sent no complete body within {timeout:g} s" if timeout else "left mid-body"
    _log.warning(
        '%s - "%s %s" %s (%d of %s bytes); dropped',
        who,
        request.method,
        request.url.path,
        why,
        size,
        length if length is not None else "?",
    )


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # less 1: opens +1, closes -1


def _nesting_depth(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest, on the raw bytes (a bound: cheap, no parse)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # nearly every body: no scan
        return 0
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)  # none inside strings
    steps = brackets.translate(_DEPTH_STEP)
    return max(itertools.accumulate(b - 1 for b in steps), default=0)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; JSON has none


async def _drain(request: HttpRequest, size: int = 0) -> None:
    """Read what the client is still sending (up to a bound), so it gets to read the 413."""
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > _DRAIN_BODY_BYTES:
                return
    except Exception:
        pass
