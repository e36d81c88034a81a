"""llama.cpp's completion shapes for the fake engine: slots, generations, replies.

docs/architecture.md ("Simulated GPU and fake engine"). What :mod:`uapplace.sim.engine`
answers ``POST /v1/completions`` and ``POST /v1/chat/completions`` with, and what its
``GET /slots`` shows, as ``llama-server`` shapes them (the engine-contract suite,
``tests/engines/test_contract.py``, checks both against the real server):

- :class:`Slot`: one parallel slot; before any task only ``id``, ``n_ctx``, ``speculative``
  and ``is_processing``; after one also ``id_task``, the prompt counts, ``params`` and
  ``next_token``.
- :func:`plan_generation`: what a request body asks for (:class:`Generation`).
- :class:`Reply`: the answer, whole (``chat.completion`` / ``text_completion`` with
  ``usage``) or streamed as SSE ``data:`` chunks (``chat.completion.chunk`` /
  ``text_completion``), the last with ``finish_reason``, then ``data: [DONE]``. Its pace
  and counters are the engine's (a ``decode`` callback).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

FILLER = " ."
"""Each token past the canned reply of a request that ignores the end of text."""

Decode = Callable[[int], Awaitable[None]]


class Slot:
    """One of the engine's parallel slots, shaped like llama.cpp's ``/slots`` entry."""

    def __init__(self, index: int, n_ctx: int) -> None:
        self.index = index
        self.n_ctx = n_ctx
        self.processing = False
        self.task: dict[str, Any] | None = None
        """The last task's figures (``id_task``, prompt, ``params``); ``None`` before any."""
        self.decoded = 0
        self.remaining = -1
        self.task_id: int | None = None

    def start(self, task_id: int, prompt_tokens: int, n_predict: int, stream: bool) -> None:
        self.processing = True
        self.task_id = task_id
        self.decoded = 0
        self.remaining = n_predict
        params = {"n_predict": n_predict, "max_tokens": n_predict, "stream": stream}
        self.task = {"id_task": task_id, "n_prompt_tokens": prompt_tokens, "params": params}

    def decode(self) -> None:
        self.decoded += 1
        if self.remaining > 0:
            self.remaining -= 1

    def finish(self) -> None:
        self.processing = False

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.index,
            "n_ctx": self.n_ctx,
            "speculative": False,
            "is_processing": self.processing,
        }
        if self.task is not None:
            body.update(
                id_task=self.task["id_task"],
                n_prompt_tokens=self.task["n_prompt_tokens"],
                n_prompt_tokens_processed=self.task["n_prompt_tokens"],
                n_prompt_tokens_cache=0,
                params=self.task["params"],
                next_token=[
                    {
                        "has_next_token": self.processing,
                        "has_new_line": False,
                        "n_remain": self.remaining,
                        "n_decoded": self.decoded,
                    }
                ],
            )
        return body


@dataclass(frozen=True)
class Generation:
    """What one completion request asks for, read from its body."""

    prompt_tokens: int
    pieces: tuple[tuple[str, int], ...]
    """The text generated, one ``(piece, tokens)`` per chunk: the canned reply, then fillers."""
    finish_reason: str
    stream: bool
    n_predict: int
    """The request's ``max_tokens``/``n_predict``; -1 when it set none."""

    @property
    def tokens(self) -> int:
        return sum(tokens for _, tokens in self.pieces)


def plan_generation(
    body: dict[str, Any], prompt_tokens: int, model: str, slot_ctx: int
) -> Generation:
    """What a request body asks for: the canned reply naming ``model`` (``Hello from <model>.``),
    cut at ``max_tokens``/``n_predict``; with ``ignore_eos``, that many tokens (fillers after
    the reply), up to what is left of the slot's context (``finish_reason`` ``length``)."""
    canned = f"Hello from {model}."
    words = canned.split(" ")
    asked = positive_int(body.get("max_tokens", body.get("n_predict")))
    stream = body.get("stream") is True
    n_predict = asked if asked is not None else -1
    if body.get("ignore_eos") is True and asked is not None:
        room = max(1, slot_ctx - prompt_tokens)
        tokens = min(asked, room)
        fillers = max(0, tokens - len(words))
        pieces = ((canned, min(tokens, len(words))), *((FILLER, 1),) * fillers)
        return Generation(prompt_tokens, pieces, "length", stream, n_predict)
    if asked is not None and asked < len(words):
        return Generation(
            prompt_tokens, ((" ".join(words[:asked]), asked),), "length", stream, n_predict
        )
    return Generation(prompt_tokens, ((canned, len(words)),), "stop", stream, n_predict)


class Reply:
    """One completion's answer in llama.cpp's shapes: an OpenAI chat or text completion,
    whole or as SSE chunks ending ``data: [DONE]``."""

    def __init__(
        self,
        chat: bool,
        generation: Generation,
        model: str,
        fingerprint: str,
        task: int,
        decode: Decode,
    ) -> None:
        self.chat = chat
        self.generation = generation
        self.model = model
        self.fingerprint = fingerprint
        """``system_fingerprint``: the engine's ``build_info``."""
        self.id = f"chatcmpl-{os.getpid()}-{task}"
        self.decode = decode
        """Generates one piece of so many tokens (the engine's pace and counters)."""

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "created": int(time.time()),
            "id": self.id,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "object": kind,
        }

    def _usage(self) -> dict[str, Any]:
        prompt, generated = self.generation.prompt_tokens, self.generation.tokens
        return {
            "completion_tokens": generated,
            "prompt_tokens": prompt,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    async def generate(self) -> None:
        for _, tokens in self.generation.pieces:
            await self.decode(tokens)

    def whole(self) -> dict[str, Any]:
        text = "".join(piece for piece, _ in self.generation.pieces)
        reason = self.generation.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"finish_reason": reason, "index": 0, "message": message}
            kind = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}
            kind = "text_completion"
        return {"choices": [choice], **self._envelope(kind), "usage": self._usage()}

    def _chunk(self, delta_or_text: Any, reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"finish_reason": reason, "index": 0, "delta": delta_or_text}
            return {"choices": [choice], **self._envelope("chat.completion.chunk")}
        choice = {"text": delta_or_text, "index": 0, "logprobs": None, "finish_reason": reason}
        return {"choices": [choice], **self._envelope("text_completion")}

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """The chunks as they are generated; a client that hangs up ends the generation."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if self.chat:
                await _send(response, self._chunk({"role": "assistant", "content": None}, None))
            for piece, tokens in self.generation.pieces:
                await self.decode(tokens)
                await _send(response, self._chunk({"content": piece} if self.chat else piece, None))
            last = self._chunk({} if self.chat else "", self.generation.finish_reason)
            if not self.chat:
                last["usage"] = self._usage()
            await _send(response, last)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream, as llama-server then stops generating
        return response


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


def positive_int(value: Any) -> int | None:
    """A positive integer field of a request body, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _words(text: Any) -> int:
    return len(str(text).split())


def prompt_tokens(body: dict[str, Any], *, chat: bool) -> int | None:
    """The prompt's size in words (the fake's tokens): ``messages`` for a chat, ``prompt``
    for a text completion; ``None`` when that field has the wrong type."""
    return _chat_prompt_tokens(body) if chat else _text_prompt_tokens(body)


def _chat_prompt_tokens(body: dict[str, Any]) -> int | None:
    """The prompt's size in words, or ``None`` when ``messages`` is not a list."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    return sum(_words(m.get("content", "")) for m in messages if isinstance(m, dict))


def _text_prompt_tokens(body: dict[str, Any]) -> int | None:
    """The prompt's size in words, or ``None`` when ``prompt`` is neither text nor a list."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, list):
        return sum(_words(p) for p in prompt)
    return None
