"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are strict: an unknown field is refused with a 400 naming it, rather
than ignored, so a client never believes a setting took effect when it did
not. OpenAI fields cbcore does not implement are accepted only at their
neutral value (``n=1``, ``echo=false``, no logprobs, zero penalties, no
tools, ``response_format`` ``{"type": "text"}``): a body that sets any of
them otherwise is refused with one message naming every such field, its
value and the neutral one (:data:`NEUTRAL_ONLY`).

Extension fields, as vLLM adds them to the body (``extra_body`` in the
``openai`` client): ``top_k``, ``ignore_eos``, ``priority``, ``deadline_s``,
``attrs`` and ``return_token_ids``. OpenAI's ``user`` field is the client
(tenant) id that fairness policies see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cbcore.scheduling.request import EMPTY_ATTRS, Attrs, DeadlineS, Priority

UNSUPPORTED_MSG = "is not supported by this server"
#: The pydantic error type of a body that sets neutral-only fields; its context lists them (the first is
#: the error's ``param``).
NEUTRAL_ONLY_ERROR = "neutral_only"
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

    #: Field -> (whether a value is neutral, the neutral value as JSON). A field is checked only when sent.
    NEUTRAL: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "n": (lambda v: v == 1, "1"),
        "presence_penalty": (lambda v: v == 0, "0"),
        "frequency_penalty": (lambda v: v == 0, "0"),
        "logit_bias": (lambda v: not v, "null or {}"),
    }

    @model_validator(mode="after")
    def _neutral_only(self) -> _Common:
        """Every field this server accepts only at its neutral value and the body sets otherwise, at once."""
        sent = [
            (name, neutral)
            for name, (is_neutral, neutral) in self.NEUTRAL.items()
            if name in self.model_fields_set and not is_neutral(getattr(self, name))
        ]
        if sent:
            one = len(sent) == 1
            listed = ", ".join(f"{name}={_shown(getattr(self, name))} (neutral: {neutral})" for name, neutral in sent)
            message = (
                f"{listed}: {'this field is' if one else 'these fields are'} not supported by this server, which "
                f"accepts {'it only at its neutral value' if one else 'them only at their neutral values'}"
            )
            # The whole message in the context: a template would read the braces of a JSON value as fields.
            raise PydanticCustomError(
                NEUTRAL_ONLY_ERROR, "{message}", {"message": message, "fields": [name for name, _ in sent]}
            )
        return self

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

    NEUTRAL: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_Common.NEUTRAL,
        "echo": (lambda v: v is False, "false"),
        "logprobs": (lambda v: v is None, "null"),
        "best_of": (lambda v: v in (None, 1), "null or 1"),
        "suffix": (lambda v: not v, 'null or ""'),
    }

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

    NEUTRAL: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_Common.NEUTRAL,
        "logprobs": (lambda v: v is False, "false"),
        "top_logprobs": (lambda v: v in (None, 0), "null or 0"),
        "tools": (lambda v: not v, "null or []"),
        # With no tools there is nothing to choose: only "none" says what happens.
        "tool_choice": (lambda v: v in (None, "none"), 'null or "none"'),
        "response_format": (lambda v: v in (None, {"type": "text"}), '{"type": "text"}'),
    }


def _shown(value: Any) -> str:
    """A value as the client wrote it (JSON), cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


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
