"""Outputs across a process boundary as deltas: what a request gained since its last output, not all of it.

A streaming engine reports every running request after every step, and each `RequestOutput`
holds the request's whole state so far (prompt ids, every token, the text). Pickled whole,
that is O(length) per request per step, O(length²) per request over a run, and it is paid in
the engine process (beside the step loop) and again in the receiving one. `DeltaEncoder` sends
each completion's new tokens, text and logprobs only, with the offset they continue from, and
the prompt once; `DeltaDecoder` on the other side rebuilds full `RequestOutput`s, so whoever
reads them (the server, `LLM.generate`) sees no difference.

Tokens and text only grow, except that a finished sample's text can be rewritten (its final
full decode, a cut at a stop string): the offset then says where the new text starts. A delta
whose offsets point past what the receiver holds continues from a message it never got: the
decoder raises `OutputGapError` rather than build a request's output with a hole in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.errors import PagedKVError


class OutputGapError(PagedKVError):
    """A delta continues from output the receiver never got (a message was lost on the way)."""


@dataclass(frozen=True)
class CompletionDelta:
    index: int
    token_offset: int  # the new token ids continue the completion's tokens from here
    token_ids: list[int]
    text_offset: int  # the new text replaces the completion's text from this character on
    text: str
    finish_reason: str | None
    logprobs_offset: int
    logprobs: list | None


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None
    metrics: dict
    prompt: str | None = None  # the prompt and its ids travel with a request's first output only
    prompt_token_ids: list[int] | None = None


def _common_prefix(old: str, new: str) -> int:
    if new.startswith(old):
        return len(old)
    size = 0
    for a, b in zip(old, new):
        if a != b:
            break
        size += 1
    return size


@dataclass
class _Sent:
    """What the other side already has of one completion."""

    num_tokens: int = 0
    text: str = ""
    num_logprobs: int = 0


class DeltaEncoder:
    """The sending side: `encode(output)` -> the `OutputDelta` that brings the receiver up to date.

    `send_prompt_token_ids=False` leaves the prompt's ids out of the first delta too, for a receiver that
    sent them itself (it passes them to `DeltaDecoder.decode`)."""

    def __init__(self, send_prompt_token_ids: bool = True):
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._send_prompt_token_ids = send_prompt_token_ids

    def encode(self, output: RequestOutput) -> OutputDelta:
        first = output.request_id not in self._sent
        sent = self._sent.setdefault(output.request_id, {})
        completions = []
        for completion in output.outputs:
            before = sent.setdefault(completion.index, _Sent())
            tokens = completion.token_ids
            token_offset = before.num_tokens if len(tokens) >= before.num_tokens else 0
            text_offset = _common_prefix(before.text, completion.text)
            logprobs = completion.logprobs
            logprobs_offset = min(before.num_logprobs, len(logprobs)) if logprobs is not None else 0
            completions.append(CompletionDelta(
                completion.index, token_offset, tokens[token_offset:], text_offset, completion.text[text_offset:],
                completion.finish_reason, logprobs_offset,
                logprobs[logprobs_offset:] if logprobs is not None else None))
            before.num_tokens, before.text = len(tokens), completion.text
            before.num_logprobs = len(logprobs) if logprobs is not None else 0
        if output.finished:
            del self._sent[output.request_id]
        return OutputDelta(output.request_id, completions, output.finished, output.num_cached_tokens, output.error,
                           output.metrics, output.prompt if first else None,
                           output.prompt_token_ids if first and self._send_prompt_token_ids else None)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (aborted: no final output will come)."""
        self._sent.pop(request_id, None)


@dataclass
class _Received:
    prompt: str | None
    prompt_token_ids: list[int]
    completions: dict[int, CompletionOutput] = field(default_factory=dict)


class DeltaDecoder:
    """The receiving side: `decode(delta)` -> the request's full `RequestOutput` (fresh lists each time)."""

    def __init__(self):
        self._received: dict[str, _Received] = {}

    def decode(self, delta: OutputDelta, prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """The request's full output so far; `prompt_token_ids`: its prompt, when the sender left it out."""
        state = self._received.get(delta.request_id)
        if state is None:
            prompt_ids = delta.prompt_token_ids if delta.prompt_token_ids is not None else prompt_token_ids
            state = self._received[delta.request_id] = _Received(delta.prompt, prompt_ids or [])
        for part in delta.completions:
            before = state.completions.get(part.index)
            have_tokens, have_text = (len(before.token_ids), len(before.text)) if before else (0, 0)
            if part.token_offset > have_tokens or part.text_offset > have_text:
                self._received.pop(delta.request_id, None)
                raise OutputGapError(f"request {delta.request_id}: sample {part.index} continues from token "
                                     f"{part.token_offset} (character {part.text_offset}), but {have_tokens} "
                                     f"tokens ({have_text} characters) arrived: an earlier output was lost")
            tokens = before.token_ids[:part.token_offset] if before else []
            text = before.text[:part.text_offset] if before else ""
            logprobs = None
            if part.logprobs is not None:
                old = (before.logprobs or []) if before else []
                logprobs = old[:part.logprobs_offset] + part.logprobs
            state.completions[part.index] = CompletionOutput(part.index, text + part.text, tokens + part.token_ids,
                                                             part.finish_reason, logprobs)
        if delta.finished:
            del self._received[delta.request_id]
        return RequestOutput(delta.request_id, state.prompt, state.prompt_token_ids,
                             [state.completions[i] for i in sorted(state.completions)], delta.finished,
                             num_cached_tokens=delta.num_cached_tokens, error=delta.error, metrics=delta.metrics)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (aborted, or its replica died)."""
        self._received.pop(request_id, None)
