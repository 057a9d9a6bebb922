"""Request validation: an OpenAI request body becomes token ids and `SamplingParams`, or a 400.

Runs in the HTTP handler, before anything is queued, so a bad request changes no engine
state. It only reads what is fixed after startup: the tokenizer, the model config (vocab
size) and the scheduler's frozen config (`check_fits`). Range checks are `SamplingParams`'
own; this module only turns its `SamplingParamsError` into a 400 naming the wire field.
"""

from __future__ import annotations

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.sampling import SamplingParams
from pagedkv.errors import InvalidArgumentError, RequestRejectedError, SamplingParamsError
from pagedkv.server.protocol import APIError, ChatMessage, SamplingFields


def check_model(requested: str | None, served: str) -> None:
    """400 unless the request names the served model (or names none)."""
    if requested is not None and requested != served:
        raise APIError(400, f"The model '{requested}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")


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


def _tokenize(engine: LLMEngine, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, f"{param} is empty: at least one token is needed", param="prompt")
    try:
        _, token_ids = engine.tokenize(prompt)
    except InvalidArgumentError as error:
        raise APIError(400, f"{param}: {error}", param="prompt") from None
    if not token_ids:
        raise APIError(400, f"{param} is empty: at least one token is needed", param="prompt")
    return token_ids


def completion_prompts(engine: LLMEngine, prompt) -> list[list[int]]:
    """Token ids of each prompt of a completion request (one prompt, or a batch)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [_tokenize(engine, prompt, "prompt")]
    return [_tokenize(engine, item, f"prompt[{i}]") for i, item in enumerate(prompt)]


def chat_prompt(engine: LLMEngine, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended (the tokenizer's chat template)."""
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template: use /v1/completions "
                            "with token-id prompts", param="messages")
    if not messages:
        raise APIError(400, "messages is empty: at least one message is needed", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                        f"{part.get('type')!r}", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry = message.model_dump(exclude_none=True)
        entry["content"] = content or ""
        conversation.append(entry)
    try:
        return engine.apply_chat_template(conversation)
    except Exception as error:  # noqa: BLE001 - templates raise whatever jinja raises
        raise APIError(400, f"could not apply the chat template: {error}", param="messages") from None


def sampling_params(body: SamplingFields, max_tokens: int | None, max_tokens_param: str) -> SamplingParams:
    """The request's `SamplingParams`; a 400 naming the wire field (`max_tokens_param` for max_tokens) if invalid."""
    options: dict = {"n": 1 if body.n is None else body.n, "ignore_eos": bool(body.ignore_eos),
                     "include_stop_str_in_output": bool(body.include_stop_str_in_output)}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.stop is not None:
        options["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        options["stop_token_ids"] = tuple(body.stop_token_ids)
    try:
        return SamplingParams(**options)
    except SamplingParamsError as error:
        param = max_tokens_param if error.field == "max_tokens" else error.field
        reason = str(error).split(": ", 1)[-1]
        raise APIError(400, f"invalid '{param}': {reason}", param=param) from None


def check_fits(engine: LLMEngine, token_ids: list[int], max_tokens: int, param: str) -> None:
    """400 (context_length_exceeded) for a request that could never be served; the engine's message has the numbers."""
    # NOTE: check_fits only reads the scheduler's frozen config, so it is safe off the engine thread.
    try:
        engine.scheduler.check_fits(len(token_ids), max_tokens)
    except RequestRejectedError as error:
        raise APIError(400, f"This request can never be served: {error}.", param=param,
                       code="context_length_exceeded") from None
