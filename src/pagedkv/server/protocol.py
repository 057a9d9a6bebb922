"""The OpenAI wire format: request bodies as pydantic models, responses and errors as plain dicts.

Only the request side is typed, because that is where bad input has to be caught and named.
Range checks stay in `SamplingParams` (one place decides what a valid temperature is); the
models here only check types and shapes. Fields the engine cannot honour (logprobs, echo,
penalties, tools, ...) are accepted only at their neutral value, so a client never silently gets
something other than what it asked for.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

#: Unsupported OpenAI fields and the only value accepted for each.
#: Unset, zero, false and empty count as neutral too.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "tools": None, "response_format": {"type": "text"},
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then pagedkv/vLLM extras).

    Strict types: `true` is not a max_tokens of 1, and "0.5" is not a temperature (ints do pass as floats).
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None  # None (like every field below) means the default: 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras, as vLLM names them
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    return_token_ids: bool | None = False  # adds token_ids (and prompt_token_ids) to each choice
    # accepted only at their neutral value (UNSUPPORTED_FIELDS)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    tools: list | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported_field(self) -> str | None:
        """The first field set to something other than its neutral value, or None."""
        for name, neutral in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value and value != neutral:
                return name
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One message. `content` is a string or a list of text parts; other keys reach the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------------- responses

class APIError(Exception):
    """An error the client gets as OpenAI's error body, with this HTTP status."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.body = error_body(message, type_, param, code)


def now() -> int:
    """`created`: Unix seconds."""
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None,
                      token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response(kind: str, response_id: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None, *, with_usage_key: bool = True) -> dict:
    """A full response or one stream chunk. `kind`: text_completion, chat.completion(.chunk)."""
    body = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if with_usage_key:
        body["usage"] = usage_
    return body


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "pagedkv", "root": name,
            "max_model_len": max_model_len}

