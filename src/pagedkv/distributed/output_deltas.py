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

Across a pipe or a Ray stream a delta travels as plain nested tuples (`to_wire`): a named tuple
pickles through a Python-level `__reduce__` and unpickles through its Python `__new__`, which at
saturation cost the Ray ingress more than decoding (plain tuples: 5x faster to pickle, 2.4x to
unpickle). `DeltaDecoder.decode` reads either form; `from_wire` gives the named form back.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.errors import PagedKVError


class OutputGapError(PagedKVError):
    """A delta continues from output the receiver never got (a message was lost on the way)."""


class CompletionDelta(NamedTuple):
    """What one completion gained (a named tuple: tens of thousands are built, pickled and read per second)."""

    index: int
    token_offset: int  # the new token ids continue the completion's tokens from here
    token_ids: list[int]
    text_offset: int  # the new text replaces the completion's text from this character on
    text: str
    finish_reason: str | None
    logprobs_offset: int
    logprobs: list | None

    @property
    def num_tokens(self) -> int:
        """The completion's token count once this delta is applied."""
        return self.token_offset + len(self.token_ids)


class OutputDelta(NamedTuple):
    """What one request gained since its last output."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None
    metrics: dict
    prompt: str | None = None  # the prompt and its ids travel with a request's first output only
    prompt_token_ids: list[int] | None = None

    @property
    def outputs(self) -> list[CompletionDelta]:
        """The completions' deltas, under `RequestOutput`'s name: code that only routes outputs (reads
        `request_id`, `finished`, `error`, and each completion's `finish_reason` and `num_tokens`) takes either."""
        return self.completions


def to_wire(delta: OutputDelta) -> tuple:
    """`delta` as plain tuples, the form that crosses a process boundary (see the module docstring)."""
    return (delta[0], [tuple(part) for part in delta[1]], *delta[2:])


def from_wire(wire: tuple) -> OutputDelta:
    """The named form of a delta that crossed a process boundary."""
    return OutputDelta(wire[0], [CompletionDelta._make(part) for part in wire[1]], *wire[2:])


def _common_prefix(old: str, new: str) -> int:
    if new.startswith(old):
        return len(old)
    size = 0
    for a, b in zip(old, new):
        if a != b:
            break
        size += 1
    return size


class _Sent:
    """What the other side already has of one completion."""

    __slots__ = ("num_tokens", "text", "num_logprobs")

    def __init__(self):
        self.num_tokens, self.text, self.num_logprobs = 0, "", 0


class DeltaEncoder:
    """The sending side: `encode(output)` -> the `OutputDelta` that brings the receiver up to date
    (`encode_wire`: the same in its wire form, for a process boundary).

    `send_prompt_token_ids=False` leaves the prompt's ids out of the first delta too, for a receiver that
    sent them itself (it passes them to `DeltaDecoder.decode`)."""

    def __init__(self, send_prompt_token_ids: bool = True):
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._send_prompt_token_ids = send_prompt_token_ids

    def encode(self, output: RequestOutput) -> OutputDelta:
        """The delta that brings the receiver up to date with `output`."""
        return from_wire(self.encode_wire(output))

    def encode_wire(self, output: RequestOutput) -> tuple:
        """`encode(output)` in its wire form (`to_wire`), built as plain tuples from the start: this runs in the
        engine process's step loop once per running request per step."""
        sent = self._sent.get(output.request_id)
        first = sent is None
        if first:
            sent = self._sent[output.request_id] = {}
        completions = []
        for completion in output.outputs:
            before = sent.get(completion.index)
            if before is None:
                before = sent[completion.index] = _Sent()
            tokens, text, logprobs = completion.token_ids, completion.text, completion.logprobs
            token_offset = before.num_tokens if len(tokens) >= before.num_tokens else 0
            text_offset = _common_prefix(before.text, text)
            logprobs_offset = min(before.num_logprobs, len(logprobs)) if logprobs is not None else 0
            completions.append((  # CompletionDelta's fields, in order
                completion.index, token_offset, tokens[token_offset:], text_offset, text[text_offset:],
                completion.finish_reason, logprobs_offset,
                logprobs[logprobs_offset:] if logprobs is not None else None))
            before.num_tokens, before.text = len(tokens), text
            before.num_logprobs = len(logprobs) if logprobs is not None else 0
        if output.finished:
            del self._sent[output.request_id]
        return (output.request_id, completions, output.finished, output.num_cached_tokens, output.error,
                output.metrics, output.prompt if first else None,  # OutputDelta's fields, in order
                output.prompt_token_ids if first and self._send_prompt_token_ids else None)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (aborted: no final output will come)."""
        self._sent.pop(request_id, None)


class _Received:
    __slots__ = ("prompt", "prompt_token_ids", "completions")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.completions: dict[int, CompletionOutput] = {}


class DeltaDecoder:
    """The receiving side: `decode(delta)` -> the request's full `RequestOutput` (fresh lists each time)."""

    def __init__(self):
        self._received: dict[str, _Received] = {}

    def decode(self, delta: OutputDelta | tuple, prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """The request's full output so far from `delta` (named, or as it came off the wire: `to_wire`);
        `prompt_token_ids`: its prompt, when the sender left it out."""
        request_id, parts, finished, num_cached_tokens, error, metrics, prompt, sent_prompt_ids = delta
        state = self._received.get(request_id)
        if state is None:
            prompt_ids = sent_prompt_ids if sent_prompt_ids is not None else prompt_token_ids
            state = self._received[request_id] = _Received(prompt, prompt_ids or [])
        completions = state.completions
        for index, token_offset, token_ids, text_offset, text, finish_reason, logprobs_offset, logprobs in parts:
            before = completions.get(index)
            have_tokens, have_text = (len(before.token_ids), len(before.text)) if before else (0, 0)
            if token_offset > have_tokens or text_offset > have_text:
                self._received.pop(request_id, None)
                raise OutputGapError(f"request {request_id}: sample {index} continues from token "
                                     f"{token_offset} (character {text_offset}), but {have_tokens} "
                                     f"tokens ({have_text} characters) arrived: an earlier output was lost")
            if before is None:
                token_ids = list(token_ids)
            else:  # one copy of what came before (a fresh list per output: a reader may still hold the last one)
                token_ids = (before.token_ids if token_offset == have_tokens
                             else before.token_ids[:token_offset]) + token_ids
                text = (before.text if text_offset == have_text else before.text[:text_offset]) + text
                if logprobs is not None:
                    logprobs = (before.logprobs or [])[:logprobs_offset] + logprobs
            completions[index] = CompletionOutput(index, text, token_ids, finish_reason, logprobs)
        if finished:
            del self._received[request_id]
        outputs = list(completions.values()) if len(completions) == 1 else [completions[i] for i in sorted(completions)]
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             num_cached_tokens=num_cached_tokens, error=error, metrics=metrics)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (aborted, or its replica died)."""
        self._received.pop(request_id, None)
