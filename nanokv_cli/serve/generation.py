"""Generation as a handler sees it: one request's tokens from the engine thread, turned into
text and cut at its stop strings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest

from ..engine.model.tokenizer import IncrementalDecoder
from .engine_loop import EngineLoop, ServeRequest
from .protocol import ApiError, ClientGone


class StopMatcher:
    """Cuts generated text at the first stop string; holds back text that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max(map(len, stops)) - 1 if stops else 0
        self.buf = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """The text that is safe to emit, and whether a stop string was found."""
        if not self.stops:
            return text, False
        buf = self.buf + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i != -1]
        if hits:
            self.buf = ""
            return buf[: min(hits)], True
        cut = len(buf) if final else max(0, len(buf) - self.hold)
        self.buf = buf[cut:]
        return buf[:cut], False


class Generation:
    """One request's tokens as they come back from the engine thread, turned into text."""

    def __init__(
        self,
        tokenizer,
        engine_loop: EngineLoop,
        req: ServeRequest,
        stops: list[str],
        incremental: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.engine_loop = engine_loop
        self.req = req
        # Text as it comes (streaming, stop strings), or decoded once at the end.
        self.decoder = IncrementalDecoder(tokenizer) if incremental else None
        self.token_ids: list[int] = []
        self.matcher = StopMatcher(stops)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.done = False  # nothing left to abort in the engine
        self.gone = False

    def client_gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        self.release()
        self.req.stream.put_nowait(("gone", None))

    def release(self) -> None:
        """Abort the request in the engine unless it is over."""
        if not self.done:
            self.done = True
            self.engine_loop.abort(self.req)

    def _end(self, item: tuple) -> None:
        kind, message = item
        self.done = True
        if kind == "gone":
            raise ClientGone()
        if kind == "rejected":
            raise ApiError(400, message, code="context_length_exceeded")
        if kind == "aborted":
            raise ApiError(503, f"request aborted: {message}", type="server_error")
        raise ApiError(500, message, type="server_error")

    async def admitted(self) -> None:
        item = await self.req.stream.get()
        if item[0] != "added":
            self._end(item)

    async def pieces(self) -> AsyncIterator[str]:
        """Text as it is generated; ``finish_reason`` is set when it ends."""
        queue = self.req.stream
        decoder = self.decoder
        while True:
            items = [await queue.get()]
            while not queue.empty():  # the client is behind: send what came as one piece
                items.append(queue.get_nowait())
            text: list[str] = []
            finished = False
            for item in items:
                if len(item) == 2:
                    self._end(item)
                token_ids, finished, reason, _, cached = item
                if not self.num_completion_tokens:
                    self.num_cached_tokens = cached
                self.num_completion_tokens += len(token_ids)
                if decoder is not None:
                    text.extend(decoder.add(t) for t in token_ids)
                    if finished:
                        text.append(decoder.flush())
                else:
                    self.token_ids.extend(token_ids)
                    if finished:
                        text.append(self.tokenizer.decode(self.token_ids))
                if finished:
                    self.finish_reason = reason
                    self.done = True
                    break
            piece, stopped = self.matcher.feed("".join(text), final=finished)
            if stopped:
                self.finish_reason = self.req.ended_by = "stop"
                self.release()
                yield piece
                return
            if piece or finished:
                yield piece
            if finished:
                return

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


async def watch_disconnect(request: HttpRequest, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` when the client disconnects (or the response is complete)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        pass
    on_gone()
