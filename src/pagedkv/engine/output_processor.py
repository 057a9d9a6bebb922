"""Requests in and outputs out: prompt tokenization, the live requests, detokenization, `RequestOutput`.

The engine owns the step pipeline; this module owns what a request looks like on either side
of it. `OutputProcessor` keeps every live request (vLLM v1's output processor does the same),
takes each step's read-back tokens apart, and turns a request's sequences into its
`RequestOutput`: it decodes only the new tokens of each step (vLLM's prefix/read offsets),
cuts the text at the first stop string, and finishes that sequence in the scheduler, so the
next step no longer runs it.

One request's failure is its own: a row that cannot be taken apart, or an output that cannot
be built, ends that request with an error output and its blocks freed; the rest are reported.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import FinishReason, Sequence
from pagedkv.errors import InvalidArgumentError

logger = logging.getLogger("pagedkv")


def tokenize_prompt(tokenizer, vocab_size: int | None, prompt) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a text or token-id prompt; ids checked against `vocab_size` if given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer: pass prompts as lists of token ids")
        return prompt, tokenizer(prompt)["input_ids"]
    # Checked by the distinct types and the extremes (C loops): a per-token Python check cost 1.8 ms for a
    # 16K-token prompt on a 2-core CPU (1.0 ms this way), all of it in the request's time to first token.
    if not isinstance(prompt, (list, tuple)) or not all(issubclass(kind, int) and kind is not bool
                                                       for kind in set(map(type, prompt))):
        raise InvalidArgumentError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if vocab_size is not None and prompt and not (min(prompt) >= 0 and max(prompt) < vocab_size):
        token = next(t for t in prompt if not 0 <= t < vocab_size)
        raise InvalidArgumentError(f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return None, list(prompt)


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation, with the tokenizer's chat template and the generation prompt."""
    if tokenizer is None:
        raise InvalidArgumentError("this model has no tokenizer, so it has no chat template")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidArgumentError(f"each chat message needs 'role' and 'content', got {message!r}")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


@dataclass
class Detokenized:
    """Incremental detokenization state of one sequence (vLLM's prefix/read offsets).

    Each step decodes only `ids[prefix_offset:]` and keeps what it adds beyond
    `ids[prefix_offset:read_offset]`, so a step costs O(new tokens), not O(output). Text that
    ends in a half-decoded character (U+FFFD) waits for the next token.
    """

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    final: bool = False  # the sequence finished and `text` is complete


@dataclass
class Request:
    """A request's sequences (n of them once parallel sampling forks) and its timing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    detok: dict[int, Detokenized] = field(default_factory=dict)  # sample index -> text so far
    logprobs: dict[int, list] = field(default_factory=dict)  # sample index -> TokenLogprobs per output token

    @property
    def is_finished(self) -> bool:
        """All n samples exist and are done."""
        return len(self.seqs) == self.params.n and all(seq.is_done for seq in self.seqs)

    @property
    def needs_sync(self) -> bool:
        """Whether its steps need their tokens before the next is scheduled: n > 1 forks, and penalties
        (the next step's logits need the host-side history).

        Stop strings do not: a stop string is found once its token is detokenized, when the next
        step is already on the device. That step's token for the sequence is dropped
        (`Scheduler.finish` forgets pending tokens), as one past EOS is: one token of wasted work
        per stopped sequence, against every request in the batch losing the host/device overlap
        for as long as a request with stop strings is live.
        """
        return self.params.n > 1 or self.params.needs_history

    def metrics(self) -> dict:
        return {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time}


class OutputProcessor:
    """The live requests, and their outputs after each step (see the module docstring)."""

    def __init__(self, tokenizer, scheduler: Scheduler, input_builder):
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # finishes a sequence whose text reached a stop string
        self.input_builder = input_builder  # whose device table rows a finished sequence gives back
        self.requests: dict[str, Request] = {}
        self.seq_to_request: dict[int, Request] = {}
        self.num_sync_requests = 0  # live requests that need their tokens before the next step (see needs_sync)
        self.num_prompt_tokens = self.num_generated_tokens = self.num_request_failures = 0
        # True: an output for every request that moved, every step, with its text so far (streaming).
        # False: outputs only for finished requests (offline generation: no per-step detokenization or
        # copies of growing token lists); stop strings are still checked every step.
        self.stream_outputs = True

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.num_sync_requests += request.needs_sync
        for seq in request.seqs:
            self.seq_to_request[seq.seq_id] = request

    def pop(self, request_id: str) -> Request | None:
        """Forget a request (finished, aborted or failed); None if it is not live."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.num_sync_requests -= request.needs_sync
            for seq in request.seqs:
                self.seq_to_request.pop(seq.seq_id, None)
                self.input_builder.release(seq.seq_id)
        return request

    def unpack(self, step_input, out, token_ids: list[list[int]], logprobs) -> dict[int, int | list[int]]:
        """seq id -> sampled token (a list of n for a forking first sample), from a step's read-back rows."""
        sampled = {}
        scheduled = out.scheduled
        wants_logprobs = logprobs is not None
        rows = zip(step_input.sample_seqs, step_input.sampling, token_ids, logprobs or itertools.repeat(None))
        for index, row, tokens, entries in rows:
            seq = scheduled[index].seq
            try:
                sampled[seq.seq_id] = tokens if len(tokens) > 1 else tokens[0]
                if wants_logprobs and row.params.logprobs is not None:
                    request = self.seq_to_request[seq.seq_id]
                    for sample_index, entry in zip(row.sample_indices, entries):
                        request.logprobs.setdefault(sample_index, []).append(entry)
            except Exception as error:  # noqa: BLE001 - contained to this request
                sampled.pop(seq.seq_id, None)
                self.scheduler.fail_request(seq.request_id, error, out)
        return sampled

    def process(self, out, sampled: dict, finished: list[Sequence]) -> list[RequestOutput]:
        """After the scheduler resolved a step: register forked children, count tokens, report what moved.

        Requests the scheduler failed while resolving (`out.failed`), and any whose output cannot be
        built (detokenization, stop strings), end alone with an error output.
        """
        for item in out.scheduled:
            self.num_prompt_tokens += max(0, min(item.end, item.seq.num_prompt_tokens) - item.start)
        for child in out.forked:
            if (request := self.requests.get(child.request_id)) is not None:
                request.seqs.append(child)
                self.seq_to_request[child.seq_id] = request
        for seq in finished:
            self.input_builder.release(seq.seq_id)
        outputs = [self.isolate(self.requests[request_id], error)
                   for request_id, error in out.failed.items() if request_id in self.requests]
        touched: dict[str, Request] = {}
        now = time.perf_counter()
        for seq_id, tokens in sampled.items():
            self.num_generated_tokens += len(tokens) if isinstance(tokens, list) else 1
            if (request := self.seq_to_request.get(seq_id)) is not None:
                if request.first_token_time is None:
                    request.first_token_time = now
                touched[request.request_id] = request
        ended = {seq.request_id for seq in finished}
        offline = not self.stream_outputs
        for request in touched.values():
            try:
                if offline:  # nothing to report until the request finishes (stop strings may finish it now)
                    if request.request_id not in ended:
                        if not request.params.stop:
                            continue
                        self.check_stop_strings(request)
                    if not request.is_finished:
                        continue
                output = self.output(request)
            except Exception as error:  # noqa: BLE001 - contained to this request
                output = self.isolate(request, error)
            if output.finished:
                self.pop(request.request_id)
            outputs.append(output)
        return outputs

    def isolate(self, request: Request, error: BaseException) -> RequestOutput:
        """End `request` alone after `error` (its blocks freed, its step-mates untouched): its error output."""
        logger.error("request %s failed in the engine and ends alone: %s: %s", request.request_id,
                     type(error).__name__, error, exc_info=error)
        self.num_request_failures += 1
        self.scheduler.fail_request(request.request_id, error)
        self.pop(request.request_id)
        return self.failed_output(request, error)

    def output(self, request: Request) -> RequestOutput:
        """The request's output now: every sample's text so far (which may finish it on a stop string)."""
        completions = []
        for seq in request.seqs:
            text = self.text(request, seq)
            reason = seq.finish_reason.value if seq.is_done else None
            logprobs = request.logprobs.get(seq.sample_index) if request.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.sample_index, text, seq.known_output_token_ids, reason,
                                                logprobs=list(logprobs) if logprobs is not None else None))
        finished = all(c.finish_reason is not None for c in completions) and request.params.n == len(completions)
        output = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                               num_cached_tokens=request.seqs[0].num_cached_tokens, metrics=request.metrics())
        if finished:
            request.finish_time = output.metrics["finish_time"] = time.perf_counter()
        return output

    @staticmethod
    def failed_output(request: Request, error: BaseException) -> RequestOutput:
        """The final output of a request the engine failed alone: what it had, and the error."""
        completions = [CompletionOutput(seq.sample_index, "", seq.known_output_token_ids,
                                        seq.finish_reason.value if seq.is_done else FinishReason.ERROR.value)
                       for seq in request.seqs]
        request.finish_time = time.perf_counter()
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True,
                             num_cached_tokens=request.seqs[0].num_cached_tokens,
                             error=f"this request failed in the engine: {type(error).__name__}: {error}",
                             metrics={**request.metrics(), "finish_time": request.finish_time})

    def check_stop_strings(self, request: Request) -> None:
        """Offline (no per-step outputs): detokenize just to find stop strings, which finish their samples."""
        if request.params.stop:
            for seq in request.seqs:
                self.text(request, seq)

    def text(self, request: Request, seq: Sequence) -> str:
        """Detokenized output so far, cut at the first stop string (which finishes the sequence)."""
        if self.tokenizer is None:
            return ""
        state = request.detok.setdefault(seq.sample_index, Detokenized())
        if state.final:
            return state.text
        ids = seq.known_output_token_ids
        decode = self.tokenizer.decode
        searched_from = len(state.text)
        if seq.is_done:
            # One full decode at the end, which also flushes a held-back partial character.
            state.text = decode(ids, skip_special_tokens=True)
            state.prefix_offset = state.read_offset = len(ids)
            state.final = True
        elif state.read_offset < len(ids):
            before = decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens=True)
            after = decode(ids[state.prefix_offset:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                state.text += after[len(before):]
                state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        params = seq.sampling_params
        if params.stop and seq.num_output_tokens >= params.min_tokens:
            self._cut_at_stop_string(state, seq, max(0, searched_from - max(len(stop) for stop in params.stop)))
        return state.text

    def _cut_at_stop_string(self, state: Detokenized, seq: Sequence, start: int) -> None:
        """Cut `state.text` at the first stop string found from `start` on, and finish `seq` there."""
        params = seq.sampling_params
        hits = [(state.text.find(stop, start), stop) for stop in params.stop]
        hits = [(at, stop) for at, stop in hits if at != -1]
        if not hits:
            return
        at, stop = min(hits)
        state.text = state.text[:at + len(stop)] if params.include_stop_str_in_output else state.text[:at]
        state.final = True
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)
        else:
            Scheduler.drop_pending(seq)  # a token still on its way is past the stop string
            if seq.finish_reason is FinishReason.LENGTH:
                seq.finish_reason = FinishReason.STOP  # the last allowed token completed a stop string
