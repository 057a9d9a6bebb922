"""Stream chunks from the per-response template are the bytes the whole body, serialized, would be."""

import json

import pytest

from pagedkv.server import protocol
from pagedkv.server.sse import ChunkEncoder, event

TEXTS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "caf\u00e9 \u4e2d\u6587 \U0001f600", "\ufffd"]
LOGPROBS = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "b": -1e-9}],
            "text_offset": [3]}


def _whole(kind: str, response_id: str, model: str, choice: dict, with_usage_key: bool) -> bytes:
    body = protocol.response(kind, response_id, 1_700_000_000, model, [choice], None, with_usage_key=with_usage_key)
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


@pytest.mark.parametrize("with_usage_key", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason, token_ids, logprobs",
                         [(None, None, None), ("stop", [1, 23, 456], None), ("length", [], LOGPROBS)])
def test_completion_chunks_match_the_serialized_body(with_usage_key, text, finish_reason, token_ids, logprobs):
    encoder = ChunkEncoder("text_completion", "cmpl-\"x\u00e9", 1_700_000_000, "m/\u00e9\"", with_usage_key)
    got = encoder.completion(3, text, finish_reason, token_ids, logprobs)
    want = _whole("text_completion", "cmpl-\"x\u00e9", "m/\u00e9\"",
                  protocol.completion_choice(3, text, finish_reason, token_ids, logprobs=logprobs), with_usage_key)
    assert got == want


@pytest.mark.parametrize("role, content", [(True, ""), (True, "hi \"there\""), (False, "caf\u00e9"), (False, None)])
@pytest.mark.parametrize("finish_reason, token_ids, logprobs",
                         [(None, None, None), ("stop", [7], {"content": [{"token": "a", "logprob": -0.1,
                                                                          "bytes": [97], "top_logprobs": []}]})])
def test_chat_chunks_match_the_serialized_body(role, content, finish_reason, token_ids, logprobs):
    encoder = ChunkEncoder("chat.completion.chunk", "chatcmpl-1", 1_700_000_000, "tiny", True)
    message = {"role": "assistant"} if role else {}
    if content is not None:
        message["content"] = content
    want = _whole("chat.completion.chunk", "chatcmpl-1", "tiny",
                  protocol.chat_delta_choice(0, message, finish_reason, token_ids, logprobs), True)
    assert encoder.chat(0, role, content, finish_reason, token_ids, logprobs) == want


def test_other_events_are_the_body_or_the_literal():
    assert event("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(event({"error": {"message": "m\u00e9"}})[6:]) == {"error": {"message": "m\u00e9"}}
