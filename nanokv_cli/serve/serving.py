"""Serving: what the handlers share (``ServerState``), from a validated body to the response,
whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.model.tokenizer import TokenizerError
from ..engine.sampling_params import SamplingParams
from ..run.loop import QueueClosed
from .cache_stream import CacheStream
from .engine_loop import EngineLoop, ServeRequest
from .generation import Generation, watch_disconnect
from .metrics import Metrics
from .protocol import ApiError, ClientGone, _Body, _Message, sse

MAX_STOP_STRINGS = 16


class ServerState:
    """What the handlers share: the model's tokenizer and limits, the engine loop, metrics."""

    def __init__(
        self,
        llm,
        engine_loop: EngineLoop,
        metrics: Metrics,
        *,
        model_name: str,
        default_max_tokens: int,
        api_key: str | None,
        guard_metrics: bool = False,
    ) -> None:
        self.tokenizer = llm.tokenizer
        self.chat_prompt = llm.chat_prompt
        self.vocab_size = llm.config.vocab_size
        self.max_model_len = llm.max_model_len
        self.model_path = llm.model_path
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key
        self.guard_metrics = guard_metrics
        self.created = int(time.time())
        self.cache_stream: CacheStream | None = None  # GET /v1/nanokv/events, set by serve()

    # -- checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
            except TokenizerError as e:  # longer than the model can take, or not Unicode
                raise ApiError(400, str(e), param="prompt") from None
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"token id {bad[0]} is out of range (the vocabulary has {self.vocab_size})",
                param="prompt",
            )
        return list(prompt)

    def chat_tokens(self, messages: list[_Message]) -> list[int]:
        rendered = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise ApiError(
                        400, "only text content parts are supported", param=f"messages.{i}"
                    )
                content = "".join(part.text for part in content)
            role = "system" if m.role == "developer" else m.role
            rendered.append({"role": role, "content": content or ""})
        try:
            return self.chat_prompt(rendered)
        except TokenizerError as e:
            raise ApiError(400, f"chat template: {e}", param="messages") from None

    def sampling(
        self, body: _Body, max_tokens: int | None, num_prompt_tokens: int
    ) -> tuple[SamplingParams, list[str]]:
        if max_tokens is None:
            # The server's default, within the model's length when the prompt leaves room.
            room = self.max_model_len - num_prompt_tokens
            max_tokens = min(self.default_max_tokens, room) if room > 0 else 1
        elif max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"model's length ({self.max_model_len})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_k = body.top_k if body.top_k is not None else 0
        if top_k == -1:  # vLLM's "no cut"
            top_k = 0
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                max_tokens=max_tokens,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
            )
        except (TypeError, ValueError) as e:  # SamplingParams names the field first
            param = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=param) from None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        for s in stops:  # as the prompt's text is: a lone surrogate can never be generated
            try:
                s.encode()
            except UnicodeEncodeError as e:
                raise ApiError(
                    400, f"stop: a lone surrogate at character {e.start}", param="stop"
                ) from None
        return params, stops

    # -- running a request -----------------------------------------------------------------

    async def generate(
        self,
        request: HttpRequest,
        body: _Body,
        tokens: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Response:
        params, stops = self.sampling(body, max_tokens, len(tokens))
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        req = ServeRequest(tokens, params, stream=asyncio.Queue(), loop=asyncio.get_running_loop())
        try:
            self.engine_loop.submit(req)
        except QueueClosed:
            raise ApiError(503, "the server is shutting down", type="server_error") from None
        gen = Generation(
            self.tokenizer, self.engine_loop, req, stops, incremental=body.stream or bool(stops)
        )
        watcher = asyncio.create_task(watch_disconnect(request, gen.client_gone))
        streaming = False
        try:
            await gen.admitted()
            head = {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()),
                "model": self.model_name,
            }
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                streaming = True
                return StreamingResponse(
                    self._events(gen, watcher, head, chat, include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            text = "".join([piece async for piece in gen.pieces()])
            req.sent = gen.num_completion_tokens  # the whole answer goes out
            return JSONResponse(self._whole(gen, head, chat, text))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                watcher.cancel()
                gen.release()

    def _whole(self, gen: Generation, head: dict, chat: bool, text: str) -> dict[str, Any]:
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": gen.usage()}

    async def _events(
        self, gen: Generation, watcher: asyncio.Task, head: dict, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}

        def chunk(piece: str | None, finish_reason: str | None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece or ""}
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason
            return sse({**head, "choices": [choice], **extra})

        # Text chunks are the template around the piece: one small json.dumps per chunk.
        before, after = chunk("@piece@", None).split('"@piece@"')
        dumps = json.JSONEncoder(ensure_ascii=False).encode
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                first.update(logprobs=None, finish_reason=None)
                yield sse({**head, "choices": [first], **extra})
            async for piece in gen.pieces():
                if piece:
                    yield before + dumps(piece) + after
                    gen.req.sent = gen.num_completion_tokens  # the chunk went out
            yield chunk(None, gen.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        except ApiError as e:
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            gen.release()
