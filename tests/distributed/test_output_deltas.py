"""Outputs cross a process boundary as deltas, and the receiver rebuilds exactly what was sent."""

import random

import pytest

from pagedkv.distributed.output_deltas import DeltaDecoder, DeltaEncoder
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs


def _evolving_outputs(rng: random.Random, request_id: str, n: int, steps: int):
    """A request's outputs over `steps` steps: tokens and text grow, text is sometimes rewritten at the end."""
    tokens = {i: [] for i in range(n)}
    texts = {i: "" for i in range(n)}
    logprobs = {i: [] for i in range(n)}
    for step in range(steps):
        last = step == steps - 1
        completions = []
        for i in range(n):
            token = rng.randrange(500)
            tokens[i].append(token)
            logprobs[i].append(TokenLogprobs(token, -rng.random(), [(token, -0.1)]))
            texts[i] += rng.choice(["a", "bc", "", "\ufffd"])
            if last and rng.random() < 0.5:
                texts[i] = texts[i][:max(0, len(texts[i]) - 2)] + "Z"  # a final decode or a stop-string cut
            completions.append(CompletionOutput(i, texts[i], list(tokens[i]), "length" if last else None,
                                                list(logprobs[i])))
        yield RequestOutput(request_id, "the prompt", [1, 2, 3], completions, last, num_cached_tokens=step,
                            metrics={"step": step})


def test_decoded_outputs_equal_the_encoded_ones():
    rng = random.Random(0)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    streams = [list(_evolving_outputs(rng, f"r{k}", n=rng.randint(1, 3), steps=rng.randint(1, 12)))
               for k in range(20)]
    while any(streams):
        stream = rng.choice([s for s in streams if s])
        output = stream.pop(0)
        assert decoder.decode(encoder.encode(output)) == output
    assert not encoder._sent and not decoder._received, "finished requests leave no state behind"


def test_a_delta_carries_only_what_is_new():
    encoder = DeltaEncoder()
    outputs = list(_evolving_outputs(random.Random(1), "r", n=1, steps=50))
    deltas = [encoder.encode(o) for o in outputs]
    assert deltas[0].prompt_token_ids == [1, 2, 3] and all(d.prompt_token_ids is None for d in deltas[1:])
    assert all(len(d.completions[0].token_ids) == 1 and len(d.completions[0].logprobs) == 1 for d in deltas)


def test_forgotten_requests_leave_no_state():
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    first = next(_evolving_outputs(random.Random(2), "gone", n=2, steps=5))
    decoder.decode(encoder.encode(first))
    encoder.forget("gone")
    decoder.forget("gone")
    assert not encoder._sent and not decoder._received


def test_a_receiver_that_sent_the_prompt_gets_no_prompt_ids_back_and_rebuilds_the_same_outputs():
    encoder, decoder = DeltaEncoder(send_prompt_token_ids=False), DeltaDecoder()
    outputs = list(_evolving_outputs(random.Random(3), "r", n=2, steps=6))
    deltas = [encoder.encode(o) for o in outputs]
    assert all(d.prompt_token_ids is None for d in deltas)
    assert [decoder.decode(d, prompt_token_ids=[1, 2, 3]) for d in deltas] == outputs


def test_a_delta_after_a_lost_one_is_a_gap_not_an_output_with_a_hole():
    from pagedkv.distributed.output_deltas import OutputGapError

    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    outputs = list(_evolving_outputs(random.Random(4), "r", n=1, steps=4))
    deltas = [encoder.encode(o) for o in outputs]
    decoder.decode(deltas[0])
    with pytest.raises(OutputGapError, match="lost"):
        decoder.decode(deltas[2])  # deltas[1] never arrived
    assert not decoder._received  # the request's state is gone with it
    with pytest.raises(OutputGapError):
        DeltaDecoder().decode(deltas[1])  # the first one never arrived


def test_the_wire_form_is_plain_tuples_and_decodes_to_the_same_outputs():
    import pickle

    from pagedkv.distributed.output_deltas import from_wire, to_wire

    encoder, wire_encoder, named, wired = DeltaEncoder(), DeltaEncoder(), DeltaDecoder(), DeltaDecoder()
    for output in _evolving_outputs(random.Random(5), "r", n=2, steps=8):
        delta = encoder.encode(output)
        assert wire_encoder.encode_wire(output) == to_wire(delta)  # built as plain tuples from the start
        wire = pickle.loads(pickle.dumps(to_wire(delta)))
        assert b"Delta" not in pickle.dumps(wire), "no class of ours to look up and call when unpickled"
        assert from_wire(wire) == delta and from_wire(wire).completions[0].index == 0
        assert wired.decode(wire) == named.decode(delta) == output
