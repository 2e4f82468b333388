"""Prompts to token ids on worker threads, after a check that costs nothing on the event loop.

Tokenising a long prompt or rendering a long conversation through the chat
template takes time proportional to its length; on the HTTP event loop that
time is taken from every stream and from ``/health``. So the loop only
counts characters: no token of the tokenizer is longer than
``max_token_chars`` characters, so a prompt of more than ``context *
max_token_chars`` characters can never fit the context and is refused at
once. What passes is tokenised (or templated) on a small thread pool, whose
work (Rust tokenizers, mostly) leaves the loop free; the stop strings'
automaton is built there too. The exact token count is then checked as
before (:func:`cbcore.serve.convert.check_prompt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cbcore.serve import convert
from cbcore.serve.convert import Limits
from cbcore.serve.errors import ApiError
from cbcore.serve.protocol import ChatRequest, CompletionRequest
from cbcore.serve.stops import automaton

T = TypeVar("T")


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: its vocabulary's longest entry.

    Vocabulary entries are at least as long as the text they decode to
    (byte-level entries spell one byte per character, SentencePiece's
    ``<0x..>`` byte tokens are longer than their byte), added and special
    tokens included, so this bounds the characters per token from above.
    """
    vocab = tokenizer.get_vocab()
    if not vocab:
        raise ValueError("the tokenizer has an empty vocabulary")
    return max(len(token) for token in vocab)


class PromptBuilder:
    def __init__(self, tokenizer: Any, limits: Limits, threads: int) -> None:
        self.tokenizer = tokenizer
        context = limits.kv_tokens if limits.max_model_len is None else min(limits.max_model_len, limits.kv_tokens)
        self.context = context
        self.max_token_chars = longest_token_chars(tokenizer)
        self.max_chars = context * self.max_token_chars
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="cbcore-tokenize")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def check_chars(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            raise ApiError(
                400,
                f"{'the messages have' if field == 'messages' else 'the prompt has'} {chars} characters; at most {self.max_chars} can fit this model's context "
                f"of {self.context} tokens (no token of its tokenizer is longer than {self.max_token_chars} "
                "characters)",
                field,
            )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def completion(self, body: CompletionRequest) -> list[int]:
        prompt = convert.single_prompt(body)
        await self._stops(body)
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            return await self._run(self._encode, prompt)
        return list(prompt)

    async def chat(self, body: ChatRequest) -> list[int]:
        messages = convert.chat_messages(body, self.tokenizer)
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        await self._stops(body)
        return await self._run(convert.render_chat, messages, self.tokenizer)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    async def _stops(self, body: ChatRequest | CompletionRequest) -> None:
        """Build (and cache) the stop strings' automaton here, not on the loop when the stream starts."""
        if body.stop:
            await self._run(automaton, tuple(body.stop))
