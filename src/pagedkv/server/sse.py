"""Stream chunks as bytes from a per-response template: the same bytes `json.dumps` of the body would give.

A streamed response sends one chunk per choice per step, and every chunk repeats the same
envelope (`id`, `object`, `created`, `model`, and `usage: null` when usage was asked for)
around one changing choice. Building the body as dicts and serializing it whole costs the
event loop a dict tree and a generic encoder walk per token. `ChunkEncoder` serializes the
envelope once per response and formats only the choice: strings through the C string escaper
that `json.dumps` itself uses, token ids as a joined list, and logprobs (rarely asked for)
through `json.dumps`. The result is byte for byte what `json.dumps(body, separators=(",", ":"))`
of `protocol.response(...)` gives (tests compare the two).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_str


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _token_ids(token_ids: list[int] | None) -> str:
    return "" if token_ids is None else ',"token_ids":[' + ",".join(map(str, token_ids)) + "]"


class ChunkEncoder:
    """`data: {...}\\n\\n` events of one streamed response (`kind`: text_completion or chat.completion.chunk)."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, with_usage_key: bool):
        self._head = (f'data: {{"id":{_json_str(response_id)},"object":{_json_str(kind)},"created":{int(created)},'
                      f'"model":{_json_str(model)},"choices":[').encode()
        self._tail = ("]" + (',"usage":null' if with_usage_key else "") + "}\n\n").encode()

    def completion(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
                   logprobs: dict | None) -> bytes:
        """A completions chunk with one choice (`protocol.completion_choice`)."""
        choice = (f'{{"index":{index},"text":{_json_str(text)},"logprobs":{"null" if logprobs is None else _dumps(logprobs)},'
                  f'"finish_reason":{"null" if finish_reason is None else _json_str(finish_reason)}'
                  f'{_token_ids(token_ids)}}}')
        return self._head + choice.encode() + self._tail

    def chat(self, index: int, role: bool, content: str | None, finish_reason: str | None,
             token_ids: list[int] | None, logprobs: dict | None) -> bytes:
        """A chat chunk with one choice (`protocol.chat_delta_choice`); its delta carries the assistant role
        when `role`, and `content` unless it is None."""
        parts = ['"role":"assistant"'] if role else []
        if content is not None:
            parts.append(f'"content":{_json_str(content)}')
        choice = (f'{{"index":{index},"delta":{{{",".join(parts)}}},'
                  f'"logprobs":{"null" if logprobs is None else _dumps(logprobs)},'
                  f'"finish_reason":{"null" if finish_reason is None else _json_str(finish_reason)}'
                  f'{_token_ids(token_ids)}}}')
        return self._head + choice.encode() + self._tail


def event(data: dict | str) -> bytes:
    """Any other event: a body serialized whole, or a literal such as `[DONE]`."""
    return f"data: {data if isinstance(data, str) else _dumps(data)}\n\n".encode()
