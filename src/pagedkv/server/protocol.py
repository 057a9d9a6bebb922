"""The OpenAI wire format: request bodies as pydantic models, responses and errors as plain dicts.

Only the request side is typed, because that is where bad input has to be caught and named.
Range checks stay in `SamplingParams` (one place decides what a valid temperature is); the
models here only check types and shapes. Fields the engine cannot honour (tools, echo, ...)
are accepted only at their neutral value, so a client never silently gets something other
than what it asked for. Unknown fields are kept (`extra="allow"`) so that validation can
name them in a 400, or ignore them when the server is configured to.

Log probabilities come back in OpenAI's two shapes: chat's `{"content": [{token, logprob,
bytes, top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.
Both are built from the engine's per-token records (`token_id`, `logprob`, `top`: a list of
(token id, logprob) pairs) and a `token_text(token_id)` function.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

#: Fields the engine cannot honour, and the only value accepted for each.
#: Unset, zero, false and empty count as neutral too.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "tools": None, "tool_choice": "none", "functions": None, "function_call": "none",
    "response_format": {"type": "text"},
}

#: Known OpenAI fields that change nothing here, accepted and ignored.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs (chat) and vLLM's for logprobs (completions)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, then pagedkv/vLLM extras).

    Strict types: `true` is not a max_tokens of 1, and "0.5" is not a temperature (ints do pass as floats).
    """

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None  # None (like every field below) means the default: 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # keys are token ids, as strings
    # extras, as vLLM names them
    top_k: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    return_token_ids: bool | None = False  # adds token_ids (and prompt_token_ids) to each choice
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # accepted only at their neutral value (UNSUPPORTED_FIELDS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None

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

    def num_logprobs(self) -> int | None:
        """How many top alternatives each token's log probability comes with, or None for no logprobs."""
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's logprob only)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    """One message. `content` is a string or a list of text parts; other keys reach the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a text prompt, or messages with the chat template applied."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses

class APIError(Exception):
    """An error the client gets as OpenAI's error body, with this HTTP status (and headers, e.g. Retry-After)."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.headers = headers
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


def _with_token_ids(choice: dict, token_ids: list[int] | None, prompt_token_ids: list[int] | None) -> dict:
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                      prompt_token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_token_ids(choice, token_ids, prompt_token_ids)


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return _with_token_ids(choice, token_ids, prompt_token_ids)


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None = None,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_token_ids(choice, token_ids, None)


def chat_logprobs(records: Sequence, token_text: Callable[[int], str]) -> dict:
    """Chat's `logprobs`: one entry per sampled token, with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(r.token_id, r.logprob),
                         "top_logprobs": [entry(token_id, logprob) for token_id, logprob in r.top]}
                        for r in records]}


def completion_logprobs(records: Sequence, token_text: Callable[[int], str], text_offset: int = 0) -> dict:
    """Completions' `logprobs`: parallel lists, with each token's offset into the choice's text.

    A `token_text` whose `adds_text` is False names tokens that put nothing into the text (a model
    without a tokenizer): their offsets do not advance.
    """
    adds_text = getattr(token_text, "adds_text", True)
    tokens, token_logprobs, top, offsets = [], [], [], []
    for r in records:
        text = token_text(r.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(r.logprob))
        top.append({token_text(token_id): _finite(logprob) for token_id, logprob in r.top})
        offsets.append(text_offset)
        text_offset += len(text) if adds_text else 0
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _finite(logprob: float) -> float:
    # NOTE: JSON has no -inf; OpenAI clients expect a number, and -9999.0 is what vLLM sends.
    value = float(logprob)
    return value if math.isfinite(value) else -9999.0


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
