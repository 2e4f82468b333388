"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are strict: an unknown field is refused with a 400 naming it, rather
than ignored, so a client never believes a setting took effect when it did
not. OpenAI fields cbcore does not implement are accepted only at their
neutral value (``n=1``, ``echo=false``, no logprobs, zero penalties) and
refused otherwise, with a message that says so.

Extension fields, as vLLM adds them to the body (``extra_body`` in the
``openai`` client): ``top_k``, ``ignore_eos``, ``priority``, ``deadline_s``,
``attrs`` and ``return_token_ids``. OpenAI's ``user`` field is the client
(tenant) id that fairness policies see.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cbcore.scheduling.request import EMPTY_ATTRS, Attrs, DeadlineS, Priority

UNSUPPORTED_MSG = "is not supported by this server"
#: Caps on ``stop``: each string is matched on every token's text, and its automaton is built per list.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256


def check_unicode(text: str) -> str:
    """Refuse a lone UTF-16 surrogate (JSON allows ``"\\ud800"``; no tokenizer can encode it)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}, "
            "which is not valid Unicode (a surrogate must be half of a pair)"
        ) from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension (guidellm sends it): usage on every chunk


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (strict: ``"5"`` is not 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1: disabled (vLLM's convention).")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, min_length=1, max_length=256)
    # Extensions.
    ignore_eos: bool = False
    priority: Priority = 0
    deadline_s: DeadlineS = None
    attrs: Attrs = Field(default_factory=lambda: EMPTY_ATTRS)
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS} are accepted")
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are accepted")
            check_unicode(s)
        return stops

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true (as OpenAI's API has it)")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n={value} {UNSUPPORTED_MSG}: send n=1 (one request per choice)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(f"penalties {UNSUPPORTED_MSG}; leave them at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError(f"logit_bias {UNSUPPORTED_MSG}")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for legacy completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str | list[int] | list[str] | list[list[int]]) -> Any:
        for text in [value] if isinstance(value, str) else value:
            if isinstance(text, str):
                check_unicode(text)
        return value

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, value: int | None) -> int:
        return 16 if value is None else value  # OpenAI: null means the default, 16

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError(f"echo {UNSUPPORTED_MSG}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError(f"logprobs {UNSUPPORTED_MSG}")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of={value} {UNSUPPORTED_MSG}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(f"suffix {UNSUPPORTED_MSG}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat templates may read more keys (name, ...)

    role: str
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        check_unicode(self.role)
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content[{i}]: a part of type {kind!r} {UNSUPPORTED_MSG} (text only)")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{i}]: a 'text' part needs a string field 'text'")
                check_unicode(part["text"])
        elif isinstance(self.content, str):
            check_unicode(self.content)
        for key, value in (self.model_extra or {}).items():
            if isinstance(value, str):
                try:
                    check_unicode(value)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None
        return self

    def text(self) -> str:
        """The message's text (content parts were checked to be text when the body was parsed)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError(f"logprobs {UNSUPPORTED_MSG}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(f"top_logprobs {UNSUPPORTED_MSG}")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError(f"tools {UNSUPPORTED_MSG}")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(f"response_format {value.get('type')!r} {UNSUPPORTED_MSG} (text only)")
        return value


# -- responses -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


FinishReason = Literal["stop", "length"] | None


def _optional() -> Any:
    """A field left out of the JSON when unset (extension fields, ``usage`` of a stream chunk)."""
    return Field(None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = _optional()
    token_ids: list[int] | None = _optional()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = _optional()
    token_ids: list[int] | None = _optional()


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = _optional()
    content: str | None = _optional()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason
    token_ids: list[int] | None = _optional()


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _optional()


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _optional()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cbcore"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
