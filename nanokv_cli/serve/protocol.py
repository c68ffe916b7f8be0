"""The OpenAI API as nanokv speaks it: request bodies and their validation, errors, SSE."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

# -- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientGone(Exception):
    """The client disconnected; its request has been aborted."""


# -- request bodies ----------------------------------------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Body(BaseModel):
    # Strict: "5" is not a number and 1.5 is not an integer (OpenAI's API answers 400 too).
    # Fields nanokv does not know are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


# Its name shows in pydantic's messages ("instance of _Message"), which clients read.
class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None


class ChatBody(_Body):
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: int | None = None


# -- validation --------------------------------------------------------------------------------

# Options of OpenAI's API that nanokv does not implement: refused unless left at their default.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "prompt_logprobs": (None, 0),
}


def _is_type_tag(x: Any) -> bool:
    """A union member's name in a pydantic error location ('str', 'list[int]', '_TextPart')."""
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool", "list", "dict")
        or "[" in x
        or x[:1].isupper()
        or x.startswith("_")
    )


def validate_body(model: type[BaseModel], body: dict[str, Any]):
    for name, defaults in _UNSUPPORTED.items():
        if name in body and not any(
            body[name] == d and type(body[name]) is type(d) for d in defaults
        ):
            raise ApiError(400, f"'{name}' is not supported by nanokv", param=name)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x)) or None
        where = f"'{param}': " if param else ""
        raise ApiError(400, f"{where}{err['msg']}", param=param) from None
    if parsed.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    return parsed


# -- server-sent events ------------------------------------------------------------------------


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
