"""The engine's request space, drawn at random: the fuzz tests of the engine, the server and the parallel engines.

Every draw comes from one `random.Random(seed)`, so a failure names its seed and replays with
`PAGEDKV_FUZZ_SEED=<seed>`. The requests mix what users send at once: n 1-8, max_tokens 1-16,
min_tokens, stop strings that hit at the first token or never, stop token ids, ignore_eos,
logprobs 0-5, penalties, logit_bias, seeds that are equal, adjacent or none, and a few that
are invalid (refused at `add_request`, never in a step).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from dataclasses import dataclass

from pagedkv import SamplingParams
from pagedkv.errors import PagedKVError

VOCAB_SIZE = 512  # the tiny models' vocabulary (pagedkv.models.loader.RANDOM_CONFIGS)
EOS_TOKEN_ID = 2
SHARED_PREFIXES = ([7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49])


def fuzz_seed(default: int = 0) -> int:
    """The base seed: `PAGEDKV_FUZZ_SEED` replays a reported failure."""
    return int(os.environ.get("PAGEDKV_FUZZ_SEED", default))


@functools.lru_cache(maxsize=None)
def letters_tokenizer():
    """A tokenizer over the tiny models' 512 ids: id i is a word of 1-4 letters from 'abcde' (ids 0-2 special).

    Texts are the words run together, so a stop string such as "a" hits within the first
    tokens of most samples, and one such as "zz" never does.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"]
    for size in itertools.count(1):
        for letters in itertools.product("abcde", repeat=size):
            words.append("".join(letters))
            if len(words) == VOCAB_SIZE:
                break
        if len(words) == VOCAB_SIZE:
            break
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@dataclass
class FuzzRequest:
    """One drawn request: its prompt, its params (None when drawing them raised) and what to expect."""

    request_id: str
    prompt: list[int]
    params: SamplingParams | None
    params_error: PagedKVError | None = None


def _draw_params(rng: random.Random) -> SamplingParams:
    """Random sampling params (may raise `SamplingParamsError` for the invalid draws, as users' bad input does)."""
    max_tokens = rng.randint(1, 16)
    options: dict = dict(n=rng.randint(1, 8), max_tokens=max_tokens)
    options["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.0, 1.5])
    if rng.random() < 0.3:
        options["top_k"] = rng.choice([1, 5, 50])
    if rng.random() < 0.3:
        options["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        options["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.4:
        options["stop"] = rng.choice([["a"], ["zz"], ["b", "zz"], ["cd"], ["eeee"]])
        options["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.3:
        options["stop_token_ids"] = rng.sample(range(3, VOCAB_SIZE), rng.randint(1, 20))
    options["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.3:
        options["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        options["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if rng.random() < 0.2:
        options["frequency_penalty"] = rng.choice([-0.5, 1.0])
    if rng.random() < 0.2:
        options["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.2:
        options["logit_bias"] = {rng.randrange(VOCAB_SIZE): rng.choice([-100.0, 5.0, 100.0])
                                 for _ in range(rng.randint(1, 3))}
    seed = rng.choice(["none", "none", "equal", "adjacent", "random"])
    if seed != "none":
        options["seed"] = {"equal": 1234, "adjacent": 1234 + rng.randint(1, 2), "random": rng.getrandbits(63)}[seed]
    if rng.random() < 0.05:  # bad input, which must be refused where it is given
        options[rng.choice(["temperature", "top_p", "logprobs", "n"])] = -1
    return SamplingParams(**options)


def draw_requests(rng: random.Random, count: int, prefix: str) -> list[FuzzRequest]:
    """`count` requests with prompts of 1-24 tokens, half of them on a shared prefix (prefix-cache hits)."""
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 16))]
        if rng.random() < 0.5:
            prompt = rng.choice(SHARED_PREFIXES) + prompt[:8]
        try:
            params, error = _draw_params(rng), None
        except PagedKVError as refused:
            params, error = None, refused
        requests.append(FuzzRequest(f"{prefix}-{i}", prompt, params, error))
    return requests


def check_final_output(request: FuzzRequest, output, context: str) -> None:
    """The promises every finished request keeps: n completions, each ended by stop or length, the
    token counts exactly within max_tokens and min_tokens."""
    params = request.params
    where = f"{context}, request {request.request_id} {params}"
    assert output.finished and output.error is None, f"{where}: ended with error {output.error!r}"
    assert sorted(c.index for c in output.outputs) == list(range(params.n)), f"{where}: completions {output.outputs}"
    for completion in output.outputs:
        count = len(completion.token_ids)
        assert completion.finish_reason in ("stop", "length"), f"{where}: finish reason {completion.finish_reason!r}"
        assert count <= params.max_tokens, f"{where}: {count} tokens > max_tokens"
        if completion.finish_reason == "length":
            assert count == params.max_tokens, f"{where}: 'length' after {count} of {params.max_tokens} tokens"
        else:
            assert count >= max(1, params.min_tokens), f"{where}: stopped after {count} < min_tokens tokens"
            stops_on_token = completion.token_ids[-1] in params.stop_token_ids or (
                not params.ignore_eos and completion.token_ids[-1] == EOS_TOKEN_ID)
            assert stops_on_token or params.stop, f"{where}: 'stop' with no stop token or string"
        if params.logprobs is not None:
            assert completion.logprobs is not None and len(completion.logprobs) == count, where


def run_batch(engine, requests, rng: random.Random, context: str) -> tuple[dict, set]:
    """Feed `requests` over the first steps, abort some at random; {request id: final output}, aborted ids."""
    pending = list(requests)
    final, aborted, live = {}, set(), []
    for step in range(10_000):
        for _ in range(rng.randint(0, 8) if step else rng.randint(1, 12)):
            if not pending:
                break
            request = pending.pop(0)
            if request.params is None:
                continue  # refused while drawing its params: SamplingParamsError, nothing queued
            try:
                engine.add_request(request.request_id, request.prompt, request.params)
            except PagedKVError:
                queued = getattr(engine, "requests", None)  # LLMEngine's; replicas keep theirs elsewhere
                assert queued is None or request.request_id not in queued, f"{context}: a refused request was queued"
                continue
            live.append(request.request_id)
        if live and rng.random() < 0.08:
            victim = live.pop(rng.randrange(len(live)))
            assert engine.abort(victim), f"{context}: abort of live request {victim} found nothing"
            aborted.add(victim)
        if not engine.has_unfinished_requests() and not pending:
            break
        for output in engine.step():  # a raise here fails the test: no step may raise
            assert output.request_id not in aborted, f"{context}: output for aborted {output.request_id}"
            if output.finished:
                final[output.request_id] = output
                live.remove(output.request_id)
        if hasattr(engine, "check_integrity"):
            engine.check_integrity()
    else:
        raise AssertionError(f"{context}: the batch did not finish in 10,000 steps")
    return final, aborted


def fail_in_resolve(monkeypatch, request_id: str, after_tokens: int) -> None:
    """Make resolving `request_id` raise once it has `after_tokens` output tokens (its step-mates untouched)."""
    from pagedkv.engine.scheduler import Scheduler

    original = Scheduler._token_stop

    def broken_for_one_request(self, seq, token, index):
        if seq.request_id == request_id and seq.num_output_tokens >= after_tokens:
            raise RuntimeError("injected failure while resolving")
        return original(self, seq, token, index)

    monkeypatch.setattr(Scheduler, "_token_stop", broken_for_one_request)


def random_lifecycles(engine, rng: random.Random, num_requests: int, draw_prompt, max_tokens: int,
                      quiet_limit: int = 3) -> None:
    """Submit `num_requests` greedy requests a few per step, abort a fifth of steps' worth at random, step until
    all are done; `check_integrity` after every step. A step that moves nothing `quiet_limit` times running
    while work remains is a stall."""
    submitted, live = 0, []
    quiet_steps = 0
    while submitted < num_requests or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if submitted < num_requests:
                params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, max_tokens), ignore_eos=True)
                engine.add_request(f"q{submitted}", draw_prompt(rng), params)
                live.append(f"q{submitted}")
                submitted += 1
        if live and rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
        outputs = engine.step()
        finished = {o.request_id for o in outputs if o.finished}
        live = [r for r in live if r not in finished]
        quiet_steps = 0 if outputs else quiet_steps + 1
        assert quiet_steps < quiet_limit or not engine.has_unfinished_requests(), "engine stalled"
        engine.check_integrity()
