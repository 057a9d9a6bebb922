"""The engine: `add_request` / `step` / `abort` over the scheduler and the model runner.

`step()` is the whole loop body and only delegates, in the order every step runs:

    schedule (Scheduler) -> StepInput (StepInputBuilder) -> execute (ModelRunner) -> update (Scheduler) -> outputs

The engine also picks the model path at startup (pagedkv's own decoder for the Llama family,
HF's modules for everything else, logged), sizes the KV pool from a memory budget, and refuses
configurations where one max-length request could not fit. With `kv_cache_dtype` FP8 the
budget is counted in one-byte blocks, and the scales are fixed at startup (checkpoint or
calibration, `pagedkv.hf.kv_scales`) before the model's HF copy is released.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from pagedkv.core.block_table import num_blocks_for
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.sequence import FinishReason, Sequence
from pagedkv.engine.step_input import StepInputBuilder
from pagedkv.errors import ConfigError, EngineDeadError, InvalidArgumentError, RequestRejectedError, StepFailedError
from pagedkv.hf.cache import kv_shape_of
from pagedkv.hf.models import load_model, load_tokenizer, parse_dtype
from pagedkv.kernels import KVPool
from pagedkv.kernels.fp8 import is_fp8, kv_cache_dtype_name, resolve_kv_cache_dtype

logger = logging.getLogger("pagedkv")

_CPU_DEFAULT_KV_BYTES = 256 * 2**20


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


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read back yet."""

    out: object  # SchedulerOutput
    step_input: object  # StepInput
    result: object  # SamplerOutput | None
    length_finished: list  # sequences `advance` finished by length
    wait_s: float = 0.0

    @property
    def rows(self) -> dict[int, int]:
        """seq id -> this step's sampling row, for the next step's inputs that are this step's tokens."""
        scheduled = self.out.scheduled
        return {scheduled[index].seq.seq_id: row for row, index in enumerate(self.step_input.sample_seqs)}


@dataclass(frozen=True)
class StepTiming:
    """Where one step's wall time went (seconds). Only `wait_s` overlaps the device's work."""

    shape: object  # the step's StepShape
    schedule_s: float
    build_s: float  # SchedulerOutput -> StepInput
    launch_s: float  # staging copy, block moves, graph replay or eager kernel launches, sampler launch
    wait_s: float  # waiting for the sampled tokens (device time not yet covered by the host)
    update_s: float  # scheduler update, detokenization, outputs

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.build_s + self.launch_s + self.wait_s + self.update_s


@dataclass
class EngineStats:
    """What `stats()` reports."""

    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    peak_used_blocks: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_rejected: int
    num_request_failures: int  # requests that failed alone inside the engine; their step-mates went on
    prefix_cache_queries: int  # blocks looked up
    prefix_cache_hits: int  # blocks found
    prefix_cache_hit_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    busy_seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of time spent in `step()`."""
        return self.num_generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    def as_dict(self) -> dict:
        data = dict(self.__dict__)
        data["tokens_per_second"] = self.tokens_per_second
        return data


def _pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but torch sees no CUDA device")
    return device


def tokenize_prompt(tokenizer, vocab_size: int | None, prompt) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a text or token-id prompt; ids checked against `vocab_size` if given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer: pass prompts as lists of token ids")
        return prompt, tokenizer(prompt)["input_ids"]
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
        raise InvalidArgumentError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if vocab_size is not None:
        for token in prompt:
            if not 0 <= token < vocab_size:
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


class LLMEngine:
    """A continuous-batching engine over any HF causal LM with standard attention."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, tokenizer=None, *,
                 tp_rank: int | None = None, tp_init_method: str | None = None):
        """`tp_rank`/`tp_init_method` are for spawned tensor-parallel workers (pagedkv.distributed.worker)."""
        self.config = config
        self.device = _pick_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Graph capture and Triton launch on the current device's stream: it must be the engine's.
            torch.cuda.set_device(self.device)
        self.tp = None
        self._workers: list = []
        self._worker_exit: str | None = None  # set by the watcher thread when a spawned worker dies
        self._dead: str | None = None
        if config.tensor_parallel_size > 1:
            self._join_tensor_parallel(model, tp_rank, tp_init_method)
        try:
            self._build(model, tokenizer)
        except Exception as error:
            if not self._workers:
                raise
            self._stop_workers()
            raise EngineDeadError(f"tensor-parallel startup failed: {self._worker_exit or error}") from error
        if hasattr(self, "_run_torchrun_worker"):  # torchrun rank > 0: serve rank 0's steps, then leave
            try:
                self._run_torchrun_worker()
            finally:
                self.close_group()
            raise SystemExit(0)

    def _build(self, model: torch.nn.Module | None, tokenizer) -> None:
        """Load the model, size the pool, build scheduler and runner (capturing graphs) - every rank alike."""
        config = self.config
        if model is None:
            dtype = parse_dtype(config.dtype) if config.dtype else (
                torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            model = load_model(config.model, dtype, self.device)
            if tokenizer is None and self.is_driver:
                tokenizer = load_tokenizer(config.model)
        elif model.config._attn_implementation != "pagedkv":
            model.set_attn_implementation("pagedkv")
        self.hf_config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.tokenizer = tokenizer
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.get_text_config().vocab_size
        num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
        num_kv_heads //= config.tensor_parallel_size  # this rank's heads (the shard checks divisibility)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        bytes_per_block = 2 * num_layers * config.block_size * num_kv_heads * head_dim * self.kv_dtype.itemsize
        kv_scales = self._kv_scales(model, tokenizer) if is_fp8(self.kv_dtype) else None
        self.model, self.model_impl = self._pick_model(model)
        # The HF model stays on CPU (the demo checks answers against its generate); on a GPU its
        # weights are freed once the own decoder holds its fused copy.
        self.hf_model = model if self.model_impl == "hf" or self.device.type != "cuda" else None
        if self.hf_model is None:
            del model
            torch.cuda.empty_cache()
        num_blocks = self._num_blocks(bytes_per_block)
        if self.tp is not None:
            num_blocks = self.tp.min_int(num_blocks)  # every rank holds the same block ids: the smallest pool wins
        capacity_tokens = num_blocks * config.block_size
        max_model_len = self._max_model_len(capacity_tokens)
        self.max_model_len = max_model_len
        num_swap_blocks = config.swap_space // bytes_per_block if config.preemption_mode == "swap" else 0
        if config.preemption_mode == "swap" and num_swap_blocks == 0:
            raise ConfigError(f"swap_space {config.swap_space} bytes holds no block of {bytes_per_block} bytes")
        self._seq_ids = itertools.count()
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks, block_size=config.block_size, max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                watermark=config.watermark, preemption_mode=config.preemption_mode,
                victim_policy=config.victim_policy, enable_chunked_prefill=config.enable_chunked_prefill,
                enable_prefix_caching=config.enable_prefix_caching, num_swap_blocks=num_swap_blocks,
            ),
            eos_token_ids=self._eos_ids(),
            seq_ids=self._seq_ids,
        )
        # One block more than the allocator hands out: CUDA-graph padding rows write their K/V there.
        self.pool = KVPool(num_layers, num_blocks + 1, config.block_size, num_kv_heads, head_dim, self.dtype,
                           self.device, kv_cache_dtype=config.kv_cache_dtype, scales=kv_scales)
        max_blocks_per_seq = num_blocks_for(max_model_len, config.block_size)
        num_table_rows = 2 * config.max_num_seqs + 1
        self.input_builder = StepInputBuilder(self.scheduler.block_manager, config.block_size, num_table_rows)
        self.runner = ModelRunner(self.model, self.pool, is_own_model=self.model_impl == "pagedkv",
                                  num_swap_blocks=num_swap_blocks, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_blocks_per_seq=max_blocks_per_seq, num_table_rows=num_table_rows,
                                  max_model_len=max_model_len, vocab_size=self.vocab_size,
                                  eos_token_ids=self._eos_ids(), scratch_slot=num_blocks * config.block_size,
                                  enforce_eager=config.enforce_eager, tp=self.tp)
        self.requests: dict[str, Request] = {}
        self._in_flight: _InFlight | None = None
        self._num_sync_requests = 0  # live requests that need their tokens before the next step (n > 1, penalties)
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._seq_to_request: dict[int, Request] = {}
        self._num_prompt_tokens = 0
        self._num_generated = 0
        self._num_request_failures = 0  # requests failed alone (isolated from their step)
        self._busy = 0.0
        # True: an output for every request that moved, every step, with its text so far (streaming).
        # False: outputs only for finished requests (offline generation: no per-step detokenization or
        # copies of growing token lists); stop strings are still checked every step.
        self.stream_outputs = True
        # Called as on_step(scheduler_output, seconds) after every step that ran the model
        # (benchmarks record step times with it to calibrate the simulator's cost model).
        self.on_step = None
        self.step_timings: list[StepTiming] | None = None  # a list turns per-phase step timing on
        kv_note = kv_cache_dtype_name(self.kv_dtype) + (f", scales from {kv_scales.source}" if kv_scales else "")
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, KV dtype %s); max_model_len %d; "
            "max concurrency at max_model_len: %.2f", num_blocks, config.block_size, capacity_tokens,
            num_blocks * bytes_per_block / 2**20, kv_note, max_model_len, capacity_tokens / max_model_len)

    # ------------------------------------------------------------------ tensor parallel
    @property
    def is_driver(self) -> bool:
        """Whether this process schedules (rank 0, or no tensor parallelism)."""
        return self.tp is None or self.tp.rank == 0

    def _join_tensor_parallel(self, model, tp_rank: int | None, init_method: str | None) -> None:
        """Start or join the tensor-parallel group (spawning workers, or as torchrun started us)."""
        from pagedkv.distributed import ParallelConfig, TensorParallel, all_reduce_mode_from_env, launched_by_torchrun
        from pagedkv.distributed.worker import free_tcp_address, run_worker, worker_entry

        size = self.config.tensor_parallel_size
        all_reduce_mode_from_env()  # a bad PAGEDKV_TP_ALL_REDUCE is refused before any process starts
        if model is not None:
            raise ConfigError("tensor_parallel_size > 1 loads the model by name in every rank: pass the model "
                              "name or path, not a loaded model object")
        # A spawned group takes GPUs first..first + size - 1 (first: the engine's device, e.g. cuda:2 for the
        # second TP=2 replica of a data-parallel server).
        first = (self.device.index or 0) if self.device.type == "cuda" else 0
        if self.device.type == "cuda" and torch.cuda.device_count() < first + size:
            raise ConfigError(f"tensor_parallel_size {size} from cuda:{first} needs GPUs {first}..{first + size - 1}, "
                              f"but torch sees {torch.cuda.device_count()}")
        torchrun = tp_rank is None and launched_by_torchrun()
        if torchrun:
            tp_rank, init_method = int(os.environ["RANK"]), "env://"
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size "
                                  f"{size}")
        elif tp_rank is None:
            tp_rank, init_method = 0, free_tcp_address()
            self._watch_stop = threading.Event()
            context = torch.multiprocessing.get_context("spawn")
            for rank in range(1, size):
                process = context.Process(target=worker_entry, args=(self.config, rank, init_method), daemon=True)
                process.start()
                self._workers.append(process)
            atexit.register(self.shutdown)
        try:
            self.tp = TensorParallel(ParallelConfig(size, tp_rank, init_method, self.device.type,
                                                    self.config.distributed_timeout_s, first_device=first),
                                     alive=self._raise_if_a_worker_died if self._workers else None)
        except BaseException:
            self._stop_workers()
            raise
        self.device = self.tp.device
        logger.info("tensor parallel: rank %d of %d, activations all-reduced over %s", self.tp.rank, size,
                    self.tp.all_reduce_mode)
        if self._workers:
            threading.Thread(target=self._watch_workers, name="pagedkv-tp-watch", daemon=True).start()
        if torchrun and tp_rank != 0:
            self._run_torchrun_worker = lambda: run_worker(self)

    def _watch_workers(self) -> None:
        """Watcher thread: when a spawned worker dies, abort the collectives so nothing waits on it forever.

        A collective whose peer is gone never completes: rank 0 would block in it (during graph
        capture at startup, or in a step) until the NCCL timeout tore the process down. Aborting
        the process group makes the blocked call fail now; the engine then reports the exit.
        """
        while not self._watch_stop.wait(0.2):
            exit_message = self._dead_worker()
            if exit_message:
                self._worker_exit = exit_message
                logger.error("%s; aborting the process group", self._worker_exit)
                self.tp.abort()
                return

    def _raise_if_a_worker_died(self) -> None:
        """`EngineDeadError` naming the exit of the first spawned worker that died (startup: nothing to fail yet)."""
        exit_message = self._dead_worker()
        if exit_message:
            raise EngineDeadError(f"{exit_message} during tensor-parallel startup")

    def _check_workers(self) -> None:
        """Raise `EngineDeadError` (failing every request) if a spawned worker has died."""
        if self._dead is None:
            exit_message = self._worker_exit or self._dead_worker()
            if exit_message:
                self._fail(exit_message)
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _dead_worker(self) -> str | None:
        """How the first spawned worker that is no longer alive exited (None while all run)."""
        for process in self._workers:
            if not process.is_alive():
                return f"tensor-parallel worker process {process.pid} exited with code {process.exitcode}"
        return None

    def _stop_workers(self) -> None:
        """Stop watching and end every spawned worker (after a failed startup or at shutdown)."""
        if self._workers:
            self._watch_stop.set()
        for process in self._workers:
            process.join(timeout=30 if self._dead is None and self._worker_exit is None else 1)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def _fail(self, reason: str) -> None:
        self._dead = reason
        logger.error("engine stopped: %s", reason)
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (rank 0 only; idempotent)."""
        if self.tp is None or not self.is_driver or getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)  # the registration kept the engine (and its pool) alive after shutdown
        if self._workers:
            self._watch_stop.set()  # workers leave on the None below: their exits are not failures
        if self._dead is None and self._worker_exit is None:
            try:
                self.tp.broadcast_object(None)
            except Exception:  # a dead peer: nothing left to tell
                pass
        self._stop_workers()
        self.close_group()

    def close_group(self) -> None:
        """Leave the tensor-parallel group: graphs first (they hold its communicator), then the group."""
        if getattr(self, "runner", None) is not None:
            self.runner.release_graphs()
        self.tp.shutdown()

    def _pick_model(self, hf_model: torch.nn.Module):
        """(model, "pagedkv" | "hf"): the own decoder where it covers the family (per `model_impl`), else HF's modules."""
        from pagedkv.models import LlamaFamilyModel, is_supported

        wanted = self.config.model_impl
        model_type = getattr(self.hf_config.get_text_config(), "model_type", None)
        if self.tp is not None and (wanted == "hf" or not is_supported(self.hf_config)):
            raise ConfigError(f"tensor parallelism runs on pagedkv's own decoder, which does not cover model_type "
                              f"{model_type!r} (or model_impl='hf' was asked for)")
        if wanted == "hf" or (wanted == "auto" and not is_supported(self.hf_config)):
            logger.info("model path: HF modules with pagedkv attention (model_type %r)", model_type)
            return hf_model, "hf"
        max_positions = self.config.max_model_len or getattr(self.hf_config.get_text_config(),
                                                               "max_position_embeddings", None)
        own = LlamaFamilyModel.from_hf(hf_model, max_positions=max_positions, tp=self.tp)  # ConfigError if not covered
        logger.info("model path: pagedkv's own decoder (model_type %r)", model_type)
        return own, "pagedkv"

    # ------------------------------------------------------------------ startup sizing
    def _kv_scales(self, hf_model: torch.nn.Module, tokenizer):
        """This rank's FP8 scales: the checkpoint's, else calibrated on the built-in text (every rank alike)."""
        from pagedkv.hf.kv_scales import kv_scales_for

        if tokenizer is None and not self.is_driver and self.config.model is not None:
            tokenizer = load_tokenizer(self.config.model)  # the same calibration tokens as rank 0
        scales = kv_scales_for(hf_model, self.kv_dtype, tokenizer=tokenizer)
        if self.tp is not None:
            scales = scales.shard(self.tp.rank, self.tp.size)
        return scales

    def _num_blocks(self, bytes_per_block: int) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        memory = cfg.kv_cache_memory
        if isinstance(memory, int):
            budget = memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * (memory if memory is not None else 0.5))
        else:
            budget = int(2**30 * memory) if memory is not None else _CPU_DEFAULT_KV_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory of {budget} bytes holds no block ({bytes_per_block} bytes per block)")
        return num_blocks

    def _max_model_len(self, capacity_tokens: int) -> int:
        cfg = self.hf_config
        text = getattr(cfg, "text_config", None) or cfg
        model_limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        wanted = self.config.max_model_len
        if wanted is not None:
            if model_limit and wanted > model_limit:
                raise ConfigError(f"max_model_len {wanted} exceeds the model's limit of {model_limit} positions")
            if wanted > capacity_tokens:
                raise ConfigError(
                    f"max_model_len {wanted} does not fit: the KV pool holds {capacity_tokens} tokens, so the "
                    f"largest model length that fits is {capacity_tokens} (raise kv_cache_memory or lower "
                    f"max_model_len)"
                )
            return wanted
        limit = model_limit or capacity_tokens
        return min(limit, capacity_tokens)

    def _eos_ids(self) -> list[int]:
        ids = set()
        for source in (self.generation_config, self.hf_config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(eos)
        return sorted(ids)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a text or token-id prompt.

        Reads only state fixed at startup (tokenizer, vocabulary size), so the server calls it
        from request handlers, off the engine thread.
        """
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request. Raises (and queues nothing) if it is malformed or could never fit."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        params.check_token_ids(self.vocab_size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        seq = Sequence(next(self._seq_ids), request_id, token_ids, params, next(self._arrivals), priority=priority,
                       seed=seed)
        request = Request(request_id, text, token_ids, params, [seq], time.perf_counter())
        self.scheduler.add(seq)
        self.requests[request_id] = request
        if params.n > 1 or params.needs_history:
            self._num_sync_requests += 1
        self._seq_to_request[seq.seq_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks return at once. False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort([s.seq_id for s in request.seqs])
        self._forget(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the loop body
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that progressed or finished.

        With async scheduling the step launched here finishes in the next call: this call
        schedules and launches step k, then waits for step k-1's tokens (which the device
        has long produced, or is about to) and reports them, while the device runs step k.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.tp is None:
            return self._step()
        self._step_sent = False
        try:
            return self._step()
        except EngineDeadError:
            raise
        except Exception as error:
            if not self._step_sent:
                raise  # failed before the workers heard of this step: the ranks are still in step
            # Under tensor parallelism a step that failed once sent (a collective that timed out, a peer
            # that broke its connection) leaves the ranks out of step: nothing can run after it.
            exit_message = self._worker_exit or self._dead_worker()  # the cause, when a worker died
            self._fail(exit_message or f"tensor-parallel step failed: {type(error).__name__}: {str(error)[:400]}")
            raise EngineDeadError(self._dead) from error

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        previous = self._in_flight
        if previous is not None and not self._can_overlap():
            outputs += self._complete(previous)
            self._in_flight = previous = None
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        step_input = self.input_builder.build(out, self._seq_to_request, self._num_samples(out),
                                              previous_rows=previous.rows if previous is not None else None)
        built = time.perf_counter()
        previous_tokens = previous.result.device_tokens if previous is not None and previous.result else None
        if self.tp is not None:
            self._check_workers()
            self._step_sent = True  # from here on a failure leaves the workers' step behind (see step)
            self.tp.broadcast_object(step_input.for_workers())
        try:
            result = self.runner.execute(step_input, previous_tokens)  # block moves run even in an empty step
        except Exception as error:
            if self.tp is not None:
                raise  # the ranks are out of step: `step` stops the engine
            # The step still in flight fed this one its tokens on the device: its requests go down with it.
            raise self._step_failed(error, out, previous.out if previous is not None else None) from error
        length_finished = self.scheduler.advance(out)
        current = _InFlight(out, step_input, result, length_finished)
        launched = time.perf_counter()
        wait_s = 0.0
        if previous is not None:
            outputs += self._complete(previous)
            wait_s = previous.wait_s
        self._in_flight = None
        if self._can_overlap() and not out.is_empty:
            self._in_flight = current
        else:
            outputs += self._complete(current)
            wait_s += current.wait_s
        end = time.perf_counter()
        self._busy += end - start
        if self.step_timings is not None and not out.is_empty:
            self.step_timings.append(StepTiming(out.shape, scheduled - start, built - scheduled, launched - built,
                                                wait_s, end - launched - wait_s))
        if self.on_step is not None and not out.is_empty:
            self.on_step(out, end - start)
        return outputs

    def _can_overlap(self) -> bool:
        return self.config.async_scheduling and self._num_sync_requests == 0

    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens, resolve them in the scheduler and report what moved."""
        waiting = time.perf_counter()
        if self.tp is not None and flight.result is not None:
            # A peer that died or stopped answering leaves this step's collectives waiting forever on the
            # device: watch the workers, and give the step `distributed_timeout_s` (NCCL's own watchdog,
            # which would end the process instead, waits twice as long: see TensorParallel).
            deadline = waiting + self.config.distributed_timeout_s
            while not flight.result.ready():
                self._check_workers()
                if time.perf_counter() > deadline:
                    self.tp.abort()
                    self._fail(f"a tensor-parallel step did not finish within distributed_timeout_s = "
                               f"{self.config.distributed_timeout_s:g} s (a peer stopped answering)")
                    raise EngineDeadError(self._dead)
                time.sleep(0.0001)
        try:  # the one device read of the step: an error here is the step's, not one request's
            token_ids = flight.result.token_ids() if flight.result is not None else []
            logprobs = flight.result.logprobs() if flight.result is not None and any(
                row.params.logprobs is not None for row in flight.step_input.sampling) else None
        except Exception as error:
            raise self._step_failed(error, flight.out) from error
        sampled = self._sampled(flight.step_input, flight.out, token_ids, logprobs)
        flight.wait_s = time.perf_counter() - waiting
        finished = flight.length_finished + self.scheduler.resolve(flight.out, sampled)
        return self._outputs(flight.out, sampled, finished)

    def _step_failed(self, error: Exception, *outs) -> StepFailedError:
        """The step itself failed (the forward pass, or reading its tokens back): fail its requests alone."""
        request_ids = sorted({item.seq.request_id for out in outs if out is not None for item in out.scheduled
                              if item.seq.request_id in self.requests})
        logger.error("an engine step failed; failing its %d requests: %s: %s", len(request_ids),
                     type(error).__name__, error, exc_info=error)
        for request_id in request_ids:
            self.abort(request_id)
        self._in_flight = None
        return StepFailedError(request_ids, f"{type(error).__name__}: {error}")

    def _num_samples(self, out) -> dict[int, int]:
        """Sequences whose step samples all n first tokens of an n > 1 request from one row."""
        wanted = {}
        for item in out.scheduled:
            seq = item.seq
            if seq.sampling_params.n > 1 and seq.sample_index == 0 and seq.num_output_tokens == 0 \
                    and item.end == seq.num_tokens and len(self._seq_to_request[seq.seq_id].seqs) == 1:
                wanted[seq.seq_id] = seq.sampling_params.n
        return wanted

    def _sampled(self, step_input, out, token_ids: list[list[int]], logprobs) -> dict[int, int | list[int]]:
        """seq id -> sampled token (a list of n for a forking first sample), from the step's read-back rows.

        A row that cannot be taken apart fails its request alone (`_isolate`), like a failure in resolve.
        """
        sampled = {}
        scheduled = out.scheduled
        rows = zip(step_input.sample_seqs, step_input.sampling, token_ids, logprobs or itertools.repeat(None))
        for index, row, tokens, entries in rows:
            seq = scheduled[index].seq
            try:
                sampled[seq.seq_id] = tokens if len(tokens) > 1 else tokens[0]
                if row.params.logprobs is not None:
                    request = self._seq_to_request[seq.seq_id]
                    for sample_index, entry in zip(row.sample_indices, entries):
                        request.logprobs.setdefault(sample_index, []).append(entry)
            except Exception as error:  # noqa: BLE001 - contained to this request
                sampled.pop(seq.seq_id, None)
                self.scheduler.fail_request(seq.request_id, error, out)
        return sampled

    def _outputs(self, out, sampled, finished) -> list[RequestOutput]:
        """Register forked children, count tokens, and report every request that moved.

        Requests the scheduler failed while resolving (`out.failed`), and any whose output cannot be
        built (detokenization, stop strings), end alone with an ERROR output; the rest are reported.
        """
        for item in out.scheduled:
            self._num_prompt_tokens += max(0, min(item.end, item.seq.num_prompt_tokens) - item.start)
        for child in out.forked:
            request = self.requests.get(child.request_id)
            if request is not None:
                request.seqs.append(child)
                self._seq_to_request[child.seq_id] = request
        for seq in finished:
            self.input_builder.release(seq.seq_id)
        outputs = [self._isolate(self.requests[request_id], error)
                   for request_id, error in out.failed.items() if request_id in self.requests]
        touched: dict[str, Request] = {}
        now = time.perf_counter()
        for seq_id, tokens in sampled.items():
            self._num_generated += len(tokens) if isinstance(tokens, list) else 1
            request = self._seq_to_request.get(seq_id)
            if request is None:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request.request_id] = request
        ended = {seq.request_id for seq in finished}
        for request in touched.values():
            try:
                output = self._report(request, request.request_id in ended)
            except Exception as error:  # noqa: BLE001 - contained to this request
                output = self._isolate(request, error)
            if output is not None:
                outputs.append(output)
        return outputs

    def _report(self, request: Request, has_ended_seq: bool) -> RequestOutput | None:
        """`request`'s output after a step that moved it (None offline, until it finishes)."""
        if not self.stream_outputs and not has_ended_seq:
            if not request.params.stop:
                return None  # offline: nothing to report until a sequence of it finishes
            for seq in request.seqs:
                self._text(request, seq)  # may finish the sequence on a stop string
        if not self.stream_outputs and not self._is_finished(request):
            return None
        output = self._output(request)
        if output.finished:
            request.finish_time = time.perf_counter()
            output.metrics["finish_time"] = request.finish_time
            self.requests.pop(request.request_id, None)
            self._forget(request)
        return output

    def _isolate(self, request: Request, error: BaseException) -> RequestOutput:
        """End `request` alone after `error` (its blocks freed, its step-mates untouched): its ERROR output."""
        logger.error("request %s failed in the engine and ends alone: %s: %s", request.request_id,
                     type(error).__name__, error, exc_info=error)
        self._num_request_failures += 1
        self.scheduler.fail_request(request.request_id, error)
        self.requests.pop(request.request_id, None)
        self._forget(request)
        completions = [CompletionOutput(seq.sample_index, "", seq.known_output_token_ids,
                                        seq.finish_reason.value if seq.is_done else FinishReason.ERROR.value)
                       for seq in request.seqs]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True,
                             num_cached_tokens=request.seqs[0].num_cached_tokens,
                             error=f"this request failed in the engine: {type(error).__name__}: {error}",
                             metrics={"arrival_time": request.arrival_time,
                                      "first_token_time": request.first_token_time,
                                      "finish_time": time.perf_counter()})

    def _text(self, request: Request, seq: Sequence) -> str:
        """Detokenized output so far, cut at the first stop string (which finishes the sequence)."""
        if self.tokenizer is None:
            return ""
        state = request.detok.setdefault(seq.sample_index, Detokenized())
        ids = seq.known_output_token_ids
        decode = self.tokenizer.decode
        searched_from = len(state.text)
        if state.final:
            return state.text
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
        text = state.text
        if params.stop and seq.num_output_tokens >= params.min_tokens:
            start = max(0, searched_from - max(len(stop) for stop in params.stop))
            hits = [(text.find(stop, start), stop) for stop in params.stop]
            hits = [(at, stop) for at, stop in hits if at != -1]
            if hits:
                at, stop = min(hits)
                text = text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
                state.text = text
                state.final = True
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                else:
                    Scheduler.drop_pending(seq)  # a token still on its way is past the stop string
                    if seq.finish_reason is FinishReason.LENGTH:
                        seq.finish_reason = FinishReason.STOP  # the last allowed token completed a stop string
        return text

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, with the tokenizer's chat template and the generation prompt."""
        return chat_token_ids(self.tokenizer, messages)

    @staticmethod
    def _is_finished(request: Request) -> bool:
        return len(request.seqs) == request.params.n and all(seq.is_done for seq in request.seqs)

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = self._text(request, seq)
            reason = seq.finish_reason.value if seq.is_done else None
            logprobs = request.logprobs.get(seq.sample_index) if request.params.logprobs is not None else None
            completions.append(CompletionOutput(seq.sample_index, text, seq.known_output_token_ids, reason,
                                                logprobs=list(logprobs) if logprobs is not None else None))
        finished = all(c.finish_reason is not None for c in completions) and request.params.n == len(completions)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time},
        )

    def _forget(self, request: Request) -> None:
        if request.params.n > 1 or request.params.needs_history:
            self._num_sync_requests -= 1
        for seq in request.seqs:
            self._seq_to_request.pop(seq.seq_id, None)
            self.input_builder.release(seq.seq_id)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> EngineStats:
        """Blocks, preemptions, swaps, prefix-cache hits and throughput so far."""
        bm = self.scheduler.block_manager
        st = self.scheduler.stats
        cache = bm.prefix_cache
        return EngineStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size, num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks, peak_used_blocks=bm.allocator.peak_used,
            num_preemptions=st.num_preemptions, num_swap_outs=st.num_swap_outs, num_swap_ins=st.num_swap_ins,
            num_rejected=st.num_rejected, num_request_failures=self._num_request_failures,
            prefix_cache_queries=cache.num_queries if cache else 0,
            prefix_cache_hits=cache.num_hits if cache else 0, prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens, num_generated_tokens=self._num_generated,
            num_steps=st.num_steps, busy_seconds=self._busy,
        )

    def check_integrity(self) -> None:
        """Assert the scheduler's queues and blocks agree (tests call this)."""
        self.scheduler.check_integrity()
