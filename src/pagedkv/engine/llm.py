"""`LLM`: the offline API. Give it prompts, get completions; the engine loop runs inside.

    from pagedkv import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceT

import torch
from tqdm.auto import tqdm

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.sequence import FinishReason
from pagedkv.errors import InvalidArgumentError, RequestRejectedError

Prompt = str | list[int]


class LLM:
    """An engine plus a loop: `generate` and `chat` block until every request finishes."""

    def __init__(self, model: str | None = None, *, block_size: int = 16, kv_cache_memory: int | float | None = None,
                 device: str | None = None, dtype: str | None = None, hf_model: torch.nn.Module | None = None,
                 tokenizer=None, **engine_options):
        """`model`: None (embedded SmolLM2), an HF id or path, a .gguf file, or `random:NAME`.

        `hf_model`/`tokenizer` pass an already loaded model. Other keywords are `EngineConfig` fields.
        """
        config = EngineConfig(model=model, block_size=block_size, kv_cache_memory=kv_cache_memory, device=device,
                              dtype=dtype, **engine_options)
        self.engine = LLMEngine(config, model=hf_model, tokenizer=tokenizer)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | SequenceT[Prompt],
                 sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 use_tqdm: bool = False, priorities: SequenceT[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids). Outputs come back in prompt order.

        A prompt that can never fit (prompt + max_tokens over max_model_len or the pool) is
        not run: its output has `error` set and finish reason "rejected", and the rest finish.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if priorities is not None and len(priorities) != len(prompts):
            raise InvalidArgumentError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        ids = []
        results: dict[str, RequestOutput] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            ids.append(request_id)
            priority = priorities[index] if priorities is not None else 0
            try:
                self.engine.add_request(request_id, prompt, p, priority=priority)
            except RequestRejectedError as error:
                results[request_id] = _rejected(request_id, prompt, str(error))
            except BaseException:
                for queued in ids[:-1]:  # all or nothing: nothing of this call stays queued
                    self.engine.abort(queued)
                raise
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm, unit="req")
        bar.update(len(results))
        streaming, self.engine.stream_outputs = self.engine.stream_outputs, False
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            self.engine.stream_outputs = streaming
            bar.close()
        return [results[request_id] for request_id in ids]

    def chat(self, messages: list[dict] | SequenceT[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation and complete it."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended."""
        return self.engine.apply_chat_template(messages)

    def stats(self) -> dict:
        """Blocks used/free, preemptions, swaps, prefix-cache hits, tokens/s (see `EngineStats`)."""
        return self.engine.stats().as_dict()


def _rejected(request_id: str, prompt: Prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    token_ids = prompt if isinstance(prompt, list) else []
    completion = CompletionOutput(0, "", [], FinishReason.REJECTED.value)
    logging.getLogger("pagedkv").warning("request %s rejected: %s", request_id, message)
    return RequestOutput(request_id, text, token_ids, [completion], True, error=message)
