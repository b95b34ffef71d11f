"""Request models of the OpenAI dialect the engine speaks, and its error type.

Unknown fields are accepted and ignored (vLLM does the same), so clients that send extra options
keep working; options the engine cannot honour (penalties, ``response_format`` other than text,
``suffix``, ``echo`` with logprobs) are refused with a 400 rather than silently ignored.
vLLM extensions understood: ``return_token_ids``, ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``add_generation_prompt``, ``chat_template_kwargs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentbolt.errors import AgentboltError
from agentbolt.web import error_body

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EngineRequestError",
    "parse_request",
]


class EngineRequestError(AgentboltError, ValueError):
    """A request the engine refuses; rendered as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.code, self.type = (
            message,
            status_code,
            param,
            code,
            type,
        )

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Sampling(_Request):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by the agentbolt engine (send 0 or leave it out)")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("at most 16 stop strings")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text is not supported by the agentbolt engine")
        for tool in self.tools or []:
            if tool.get("type") != "function" or not isinstance(tool.get("function", {}).get("name"), str):
                raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        return self

    @property
    def wants_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported by the agentbolt engine")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by the agentbolt engine")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported by the agentbolt engine")
        if self.prompt == [] or self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate ``body`` into ``model``, turning pydantic errors into one OpenAI-style 400."""
    if not isinstance(body, Mapping):
        raise EngineRequestError("request body must be a JSON object")
    try:
        return model.model_validate(dict(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise EngineRequestError(f"{message} ({param})" if param else message, param=param) from None
