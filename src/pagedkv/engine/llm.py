"""`LLM`: the offline API. Give it prompts, get completions; the engine loop runs inside.

    from pagedkv import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}])

A prompt is a string, token ids (a list or tuple of ints, a 1-D numpy array or tensor), or a
vLLM-style dict (`{"prompt_token_ids": [...]}` or `{"prompt": "..."}`); `generate` takes one
prompt or a sequence of them (a 2-D array or tensor is a batch of rows). A tuple of ints is
one prompt, never a batch of one-token prompts.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from collections.abc import Sequence as SequenceT

import torch
from tqdm.auto import tqdm

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.sequence import FinishReason
from pagedkv.errors import ConfigError, InvalidArgumentError, RequestRejectedError

Prompt = str | list[int]


def _token_ids(value, where: str) -> list[int] | None:
    """`value` as a list of token ids, or None if it is not a token-id sequence at all."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy array or torch tensor
        if value.ndim != 1:
            raise InvalidArgumentError(f"{where}: token ids must be 1-D, got an array of shape {tuple(value.shape)}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
        raise InvalidArgumentError(f"{where}: token ids must be ints, got {value[:8]!r}")
    return [int(t) for t in value]


def _as_prompt(prompt, where: str) -> Prompt:
    """One prompt as text or a list of token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
            if ids is None:
                raise InvalidArgumentError(f"{where}['prompt_token_ids'] must be a list of token ids")
            return ids
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        raise InvalidArgumentError(f"{where}: a dict prompt needs 'prompt_token_ids' (token ids) or 'prompt' (text), "
                                   f"got keys {sorted(prompt)}")
    ids = _token_ids(prompt, where)
    if ids is None:
        raise InvalidArgumentError(f"{where}: a prompt is text, token ids or a dict with 'prompt_token_ids', got "
                                   f"{type(prompt).__name__}")
    return ids


def as_prompts(prompts) -> list[Prompt]:
    """The batch that `prompts` stands for: one prompt of any accepted form, or a sequence of them."""
    is_array = hasattr(prompts, "tolist") and hasattr(prompts, "ndim")
    if isinstance(prompts, (str, dict)) or (is_array and prompts.ndim == 1):
        return [_as_prompt(prompts, "prompt")]
    if is_array:
        if prompts.ndim != 2:
            raise InvalidArgumentError(f"prompts: an array of prompts must be 2-D, got shape {tuple(prompts.shape)}")
        return [_as_prompt(row, f"prompts[{i}]") for i, row in enumerate(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Number):
        return [_as_prompt(prompts, "prompt")]  # numbers are token ids of one prompt (ints checked there)
    if not isinstance(prompts, Iterable):
        raise InvalidArgumentError(f"prompts must be a prompt or a sequence of prompts, got {type(prompts).__name__}")
    return [_as_prompt(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompts)]


class LLM:
    """An engine plus a loop: `generate` and `chat` block until every request finishes."""

    def __init__(self, model: str | None = None, *, block_size: int = 16, kv_cache_memory: int | float | None = None,
                 device: str | None = None, dtype: str | None = None, kv_cache_dtype: str = "auto",
                 hf_model: torch.nn.Module | None = None, tokenizer=None, data_parallel_size: int = 1,
                 **engine_options):
        """`model`: None (embedded SmolLM2), an HF id or path, a .gguf file, or `random:NAME`.

        `kv_cache_dtype`: "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2" (see `EngineConfig`).

        `hf_model`/`tokenizer` pass an already loaded model. `data_parallel_size` > 1 runs that
        many engine replicas (one process and device each) behind the prefix-aware router. Other
        keywords are `EngineConfig` fields (`tensor_parallel_size` among them).
        """
        config = EngineConfig(model=model, block_size=block_size, kv_cache_memory=kv_cache_memory, device=device,
                              dtype=dtype, kv_cache_dtype=kv_cache_dtype, **engine_options)
        if config.tensor_parallel_size > 1 and data_parallel_size == 1:
            from pagedkv.distributed.executor import serve_torchrun_rank

            if serve_torchrun_rank(config):
                # A torchrun rank > 0 has served rank 0's steps until it shut down: only rank 0 runs
                # the rest of the script (it alone holds the requests and their outputs).
                raise SystemExit(0)
        if data_parallel_size > 1:
            if hf_model is not None:
                raise ConfigError("data_parallel_size > 1 loads the model by name in every replica: pass the model "
                                  "name or path, not a loaded model object")
            from pagedkv.distributed.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(config, data_parallel_size, tokenizer=tokenizer)
        else:
            self.engine = LLMEngine(config, model=hf_model, tokenizer=tokenizer)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 use_tqdm: bool = False, priorities: SequenceT[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt (see the module docstring for the forms). Outputs come back in prompt order.

        A prompt that can never fit (prompt + max_tokens over max_model_len or the pool) is
        not run: its output has `error` set and finish reason "rejected", and the rest finish.
        """
        prompts = as_prompts(prompts)
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
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidArgumentError("this model's tokenizer has no chat template: pass plain prompts instead")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended."""
        return self.engine.apply_chat_template(messages)

    def stats(self) -> dict:
        """Blocks used/free, preemptions, swaps, prefix-cache hits, KV tiers, tokens/s (see `EngineStats`)."""
        return self.engine.stats().as_dict()

    def shutdown(self) -> None:
        """Write the KV disk tier's prefixes (if one is on) and stop tensor-parallel workers (idempotent)."""
        self.engine.shutdown()


def _rejected(request_id: str, prompt: Prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    token_ids = prompt if isinstance(prompt, list) else []
    completion = CompletionOutput(0, "", [], FinishReason.REJECTED.value)
    logging.getLogger("pagedkv").warning("request %s rejected: %s", request_id, message)
    return RequestOutput(request_id, text, token_ids, [completion], True, error=message)
