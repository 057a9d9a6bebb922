"""Request validation: an OpenAI request body becomes token ids and `SamplingParams`, or a 400.

Runs before anything is queued, so a bad request changes no engine state, and off the event
loop (the app calls `prepare_*` in its tokenizer thread), so a slow tokenizer stalls no other
client. It only reads what is fixed after startup: the tokenizer, the model config (through
`engine.tokenize`) and the scheduler's frozen config (`check_fits`).

Cheap checks come first and the tokenizer last: unknown fields, lone surrogates, roles, and
a prompt with more characters than max_model_len tokens can hold (`Limits.max_prompt_chars`)
are refused before a tokenizer sees them. Range checks are `SamplingParams`' own; this module
turns its `SamplingParamsError` into a 400 naming the wire field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedkv.engine.client import EngineClient
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import InvalidArgumentError, RequestRejectedError, SamplingParamsError
from pagedkv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

#: Sampler fields that have a neutral value: a request may send that value to a server whose
#: `SamplingParams` lacks the field, and the field is then left out.
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
            "logit_bias": {}}


@dataclass(frozen=True)
class Limits:
    """What validation enforces beyond `SamplingParams` and the scheduler (from `ServerConfig`)."""

    served_model_name: str
    max_prompt_chars: int | None = None  # None: no character bound (no tokenizer, or one that drops characters)
    ignore_unknown_fields: bool = False


def prompt_chars_bound(engine: EngineClient) -> int | None:
    """The most characters a prompt of max_model_len tokens can have, or None if it cannot be bounded.

    Each token covers at most as many characters as the longest vocabulary entry (byte-level
    entries count one character per byte, which is at least the characters they decode to).
    A normalizer can fold characters together (NFC composes up to three Hangul jamo into one),
    so the bound is four times larger when there is one; a pre-tokenizer that drops whitespace
    removes any bound at all.
    """
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and any(name in repr(backend.pre_tokenizer) for name in ("Whitespace", "BertPre")):
        return None
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: no bound
        return None
    normalizer = getattr(backend, "normalizer", None) if backend is not None else "unknown"
    has_normalizer = normalizer is not None and not (hasattr(normalizer, "__len__") and len(normalizer) == 0)
    return engine.max_model_len * max(longest, 1) * (4 if has_normalizer else 1)


# ---------------------------------------------------------------------- checks that need no tokenizer

def check_model(requested: str | None, served: str) -> None:
    """404 `model_not_found` unless the request names the served model (or names none), as OpenAI answers."""
    if requested is not None and requested != served:
        raise APIError(404, f"The model {requested!r} does not exist; this server serves {served!r}.",
                       param="model", code="model_not_found")


def check_known_fields(body, limits: Limits) -> None:
    """400 naming the first field this API does not know (a typo such as max_token goes unnoticed otherwise)."""
    extra = body.model_extra or {}
    if extra and not limits.ignore_unknown_fields:
        name = next(iter(extra))
        raise APIError(400, f"Unrecognized request argument supplied: {name!r}.", param=name, code="unknown_field")


def _first_surrogate(value, path: str) -> str | None:
    """The path of the first string (or key) under `value` holding a lone UTF-16 surrogate."""
    if isinstance(value, str):
        return path if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_surrogate(key, path) or _first_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def check_text(body) -> None:
    """400 for a lone surrogate anywhere in the body: no tokenizer or JSON encoder can take one."""
    path = _first_surrogate(body.model_dump(exclude_none=True), "")
    if path is not None:
        raise APIError(400, f"Invalid '{path}': the text holds a lone UTF-16 surrogate (such as \\ud800), which "
                            f"is not valid Unicode.", param=path)


def check_supported(body: SamplingFields) -> None:
    """400 for a field this server cannot honour, set to anything but its neutral value."""
    name = body.unsupported_field()
    if name is not None:
        raise APIError(400, f"'{name}' is not supported by this server (got {getattr(body, name)!r})", param=name)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        raise APIError(400, f"'best_of' is not supported unless it equals n (got best_of={best_of}, n={body.n})",
                       param="best_of")
    for name in ("echo", "suffix"):
        if getattr(body, name, None):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def check_prompt_chars(num_chars: int, limits: Limits, max_model_len: int, param: str) -> None:
    """400 for text too long to fit max_model_len tokens, before any tokenizer sees it."""
    limit = limits.max_prompt_chars
    if limit is not None and num_chars > limit:
        raise APIError(400, f"'{param}' is too long: {num_chars:,} characters cannot fit in max_model_len "
                            f"{max_model_len} tokens (at most {limit:,} characters are accepted).",
                       param=param, code="context_length_exceeded")


def _message_text(messages: list[ChatMessage]) -> list[str]:
    """Each message's content as one string; 400 for a bad role, missing content or a non-text part."""
    texts = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise APIError(400, f"Invalid 'messages[{i}].role': {message.role!r} is not one of "
                                f"{', '.join(CHAT_ROLES)}.", param=f"messages[{i}].role")
        content = message.content
        if content is None:
            raise APIError(400, f"Missing 'messages[{i}].content': every message needs content (a string or a "
                                f"list of text parts; tool calls are not supported).", param=f"messages[{i}].content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                        f"{part.get('type')!r}", param=f"messages[{i}].content")
                parts.append(part["text"])
            content = "\n".join(parts)
        texts.append(content)
    return texts


# ---------------------------------------------------------------------- tokenizing

def _tokenize(engine: EngineClient, prompt: str | list[int], param: str, limits: Limits) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"{param} is empty: at least one token is needed", param=param)
        check_prompt_chars(len(prompt), limits, engine.max_model_len, param)
    try:
        _, token_ids = engine.tokenize(prompt)
    except InvalidArgumentError as error:
        raise APIError(400, f"{param}: {error}", param=param) from None
    if not token_ids:
        raise APIError(400, f"{param} is empty: at least one token is needed", param=param)
    return token_ids


def completion_prompts(engine: EngineClient, prompt, limits: Limits) -> list[list[int]]:
    """Token ids of each prompt of a completion request (one prompt, or a batch)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [_tokenize(engine, prompt, "prompt", limits)]
    return [_tokenize(engine, item, f"prompt[{i}]", limits) for i, item in enumerate(prompt)]


def _conversation(engine: EngineClient, messages: list[ChatMessage], limits: Limits) -> list[dict]:
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template: use /v1/completions "
                            "with token-id prompts", param="messages")
    if not messages:
        raise APIError(400, "messages is empty: at least one message is needed", param="messages")
    texts = _message_text(messages)
    check_prompt_chars(sum(map(len, texts)), limits, engine.max_model_len, "messages")
    conversation = []
    for message, text in zip(messages, texts):
        entry = message.model_dump(exclude_none=True)
        entry["content"] = text
        conversation.append(entry)
    return conversation


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], limits: Limits) -> list[int]:
    """Token ids of a conversation with the generation prompt appended (the tokenizer's chat template)."""
    conversation = _conversation(engine, messages, limits)
    try:
        return engine.apply_chat_template(conversation)
    except Exception as error:  # noqa: BLE001 - templates raise whatever jinja raises
        raise APIError(400, f"could not apply the chat template: {error}", param="messages") from None


# ---------------------------------------------------------------------- sampling

def _sampling_fields() -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(SamplingParams))


def _logit_bias(engine: EngineClient, bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` (token-id strings -> bias) with integer keys inside the vocabulary."""
    result = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(400, f"Invalid 'logit_bias': keys must be token ids, got {key!r}", param="logit_bias")
        result[int(key)] = value
    try:
        engine.tokenize(sorted(result))  # checks every id against the vocabulary
    except InvalidArgumentError as error:
        raise APIError(400, f"Invalid 'logit_bias': {error}", param="logit_bias") from None
    return result


def sampling_params(engine: EngineClient, body: SamplingFields, max_tokens: int | None,
                    max_tokens_param: str) -> SamplingParams:
    """The request's `SamplingParams`; a 400 naming the wire field (`max_tokens_param` for max_tokens) if invalid."""
    options: dict = {"n": 1 if body.n is None else body.n, "ignore_eos": bool(body.ignore_eos),
                     "include_stop_str_in_output": bool(body.include_stop_str_in_output)}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.stop is not None:
        options["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        options["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.logit_bias is not None:
        options["logit_bias"] = _logit_bias(engine, body.logit_bias)
    logprobs_param = "logprobs"
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if body.top_logprobs is not None:
            logprobs_param = "top_logprobs"
    if body.num_logprobs() is not None:
        options["logprobs"] = body.num_logprobs()
    known = _sampling_fields()
    for name in [name for name in options if name not in known]:
        if name in _NEUTRAL and options[name] == _NEUTRAL[name]:
            del options[name]
            continue
        wire = logprobs_param if name == "logprobs" else name
        raise APIError(400, f"'{wire}' is not supported by this server yet", param=wire)
    try:
        return SamplingParams(**options)
    except SamplingParamsError as error:
        param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(error.field, error.field)
        reason = str(error).split(": ", 1)[-1]
        raise APIError(400, f"Invalid '{param}': {reason}", param=param) from None


def check_fits(engine: EngineClient, token_ids: list[int], params: SamplingParams, prompt_param: str,
               max_tokens_param: str) -> None:
    """400 for a request that could never be served; the engine's message has the numbers.

    `param` names the prompt field when the prompt alone cannot fit, else the max-tokens field
    (`max_tokens_param`), the one the client should lower.
    """
    # NOTE: check_fits reads only the frozen config, so it is safe off the engine thread.
    try:
        engine.check_fits(len(token_ids), params.max_tokens)
    except RequestRejectedError as error:
        try:
            engine.check_fits(len(token_ids), 1)
            param = max_tokens_param
        except RequestRejectedError:
            param = prompt_param
        raise APIError(400, f"This request can never be served: {error}.", param=param,
                       code="context_length_exceeded") from None
    try:
        engine.check_fits(len(token_ids), params.max_tokens, n=params.n)
    except RequestRejectedError as error:  # it fits alone, so n is what cannot
        raise APIError(400, f"Invalid 'n': {error}.", param="n") from None


# ---------------------------------------------------------------------- whole requests

def _common(body, limits: Limits) -> None:
    check_known_fields(body, limits)
    check_text(body)
    check_model(body.model, limits.served_model_name)


def prepare_completion(engine: EngineClient, body: CompletionRequest,
                       limits: Limits) -> tuple[list[list[int]], SamplingParams]:
    """(token ids of each prompt, SamplingParams) of a completion request, or an `APIError`."""
    _common(body, limits)
    check_supported(body)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    params = sampling_params(engine, body, max_tokens, "max_tokens")
    prompts = completion_prompts(engine, body.prompt, limits)
    for token_ids in prompts:
        check_fits(engine, token_ids, params, "prompt", "max_tokens")
    return prompts, params


def prepare_chat(engine: EngineClient, body: ChatCompletionRequest, limits: Limits) -> tuple[list[int], SamplingParams]:
    """(token ids of the templated conversation, SamplingParams) of a chat request, or an `APIError`."""
    _common(body, limits)
    check_supported(body)
    if body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
    sampling_params(engine, body, max_tokens or 1, param)  # refuse bad sampling fields before tokenizing
    token_ids = chat_prompt(engine, body.messages, limits)
    if max_tokens is None:  # OpenAI's chat default: whatever room the context leaves
        max_tokens = max(1, engine.max_model_len - len(token_ids))
    params = sampling_params(engine, body, max_tokens, param)
    check_fits(engine, token_ids, params, "messages", param)
    return token_ids, params


def prepare_tokenize(engine: EngineClient, body: TokenizeRequest, limits: Limits) -> list[int]:
    """Token ids of /tokenize's prompt, or of its messages with the chat template applied."""
    _common(body, limits)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "/tokenize needs exactly one of 'prompt' and 'messages'", param="prompt")
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="prompt" if body.prompt is not None else "messages")
    if body.messages is not None:
        conversation = _conversation(engine, body.messages, limits)
        try:
            encoded = engine.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                add_special_tokens=bool(body.add_special_tokens))
        except Exception as error:  # noqa: BLE001 - templates raise whatever jinja raises
            raise APIError(400, f"could not apply the chat template: {error}", param="messages") from None
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    check_prompt_chars(len(body.prompt), limits, engine.max_model_len, "prompt")
    add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
    return list(engine.tokenizer(body.prompt, add_special_tokens=add_special_tokens)["input_ids"])


def prepare_detokenize(engine: EngineClient, body: DetokenizeRequest, limits: Limits) -> str:
    """The text of /detokenize's token ids."""
    _common(body, limits)
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    try:
        engine.tokenize(body.tokens)  # checks every id against the vocabulary
    except InvalidArgumentError as error:
        raise APIError(400, f"Invalid 'tokens': {error}", param="tokens") from None
    return engine.tokenizer.decode(body.tokens)
