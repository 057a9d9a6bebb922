"""The engine: `add_request` / `step` / `abort` over the scheduler and the model runner.

`step()` is the whole loop body and only delegates, in the order every step runs:

    schedule (Scheduler) -> StepInput (StepInputBuilder) -> execute (ModelRunner) -> update (Scheduler)
        -> outputs (OutputProcessor)

Startup lives in `engine.startup`; under tensor parallelism the group lives in `distributed.executor`
and this engine is rank 0 (it schedules, sends each step to the workers and samples). A request that
fails while resolving, reading back or detokenizing ends alone (`OutputProcessor.isolate`); a failed
forward pass raises `StepFailedError` naming that step's requests, and the others go on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from pagedkv.engine import startup
from pagedkv.engine.client import QueueSizes
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.output_processor import OutputProcessor, Request, chat_token_ids, tokenize_prompt
from pagedkv.engine.outputs import EngineStats, RequestOutput, StepTiming
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.sequence import Sequence
from pagedkv.engine.step_input import StepInput, StepInputBuilder
from pagedkv.errors import ConfigError, EngineDeadError, InvalidArgumentError, StepFailedError

logger = logging.getLogger("pagedkv")


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


class LLMEngine:
    """A continuous-batching engine over any HF causal LM with standard attention."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, tokenizer=None):
        """Load `model` (or `config.model`), size the pool, build scheduler and runner (see `engine.startup`)."""
        self.config = config
        self.device = startup.pick_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Graph capture and Triton launch on the current device's stream: it must be the engine's.
            torch.cuda.set_device(self.device)
        self.executor = None  # the tensor-parallel group, when there is one
        self._dead: str | None = None
        if config.tensor_parallel_size > 1:
            from pagedkv.distributed.executor import TensorParallelExecutor

            if model is not None:
                raise ConfigError("tensor_parallel_size > 1 loads the model by name in every rank: pass the "
                                  "model name or path, not a loaded model object")
            self.executor = TensorParallelExecutor(config, self.device)
            self.device = self.executor.device
        try:
            self._build(model, tokenizer)
        except Exception as error:
            if self.executor is None:
                raise
            raise self.executor.startup_failed(error) from error

    def _build(self, model: torch.nn.Module | None, tokenizer) -> None:
        config = self.config
        setup = startup.load_model_setup(config, self.device, self.tp, model, tokenizer)
        plan = startup.plan_pool(config, setup, self.device, self.tp)
        for name in ("model", "model_impl", "hf_model", "hf_config", "generation_config", "tokenizer", "dtype",
                     "vocab_size", "kv_dtype"):
            setattr(self, name, getattr(setup, name))
        self.max_model_len = plan.max_model_len
        self._seq_ids = itertools.count()
        self.scheduler = startup.build_scheduler(config, setup, plan, self._seq_ids)
        self.pool, self.runner = startup.build_runner(config, setup, plan, self.device, self.tp)
        self._index_disk()
        tiers = self.scheduler.block_manager.tiers
        if config.kv_offload_early_restore and tiers is not None and self.runner.offload is not None \
                and self.tp is None:  # (under TP every rank would have to stage its own shard)
            tiers.stage_restore = self.runner.offload.stage_restore
        self.input_builder = StepInputBuilder(self.scheduler.block_manager, config.block_size,
                                              startup.num_table_rows(config))
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.input_builder)
        self._in_flight: _InFlight | None = None
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._busy = 0.0
        # Called as on_step(scheduler_output, seconds) after every step that ran the model
        # (benchmarks record step times with it to calibrate the simulator's cost model).
        self.on_step = None
        self.step_timings: list[StepTiming] | None = None  # a list turns per-phase step timing on
        startup.log_pool(setup, plan)

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests, by id."""
        return self.output_processor.requests

    @property
    def stream_outputs(self) -> bool:
        """Whether every step reports every request that moved (serving), or only finished ones (offline)."""
        return self.output_processor.stream_outputs

    @stream_outputs.setter
    def stream_outputs(self, value: bool) -> None:
        self.output_processor.stream_outputs = value

    @property
    def tp(self):
        """This rank's `TensorParallel` handle, or None without tensor parallelism."""
        return self.executor.tp if self.executor is not None else None

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a text or token-id prompt.

        Reads only state fixed at startup (tokenizer, vocabulary size), so the server calls it
        from request handlers, off the engine thread.
        """
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, with the tokenizer's chat template and the generation prompt."""
        return chat_token_ids(self.tokenizer, messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, block_hashes: list[bytes] | None = None) -> None:
        """Queue a request. Raises (and queues nothing) if it is malformed or could never fit.

        `block_hashes`: prefix-cache keys of the prompt's leading full blocks as a router computed
        them (`Router.prompt_block_hashes`), reused instead of hashing the prompt again. Trusted:
        only pagedkv's own routers pass them.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        params.check_token_ids(self.vocab_size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        if block_hashes is not None and not all(isinstance(key, bytes) for key in block_hashes):
            raise InvalidArgumentError(f"block_hashes must be a list of bytes keys, got {type(block_hashes).__name__}")
        seq = Sequence(next(self._seq_ids), request_id, token_ids, params, next(self._arrivals), priority=priority,
                       seed=seed, block_hashes=list(block_hashes or ()))
        self.scheduler.add(seq)
        self.output_processor.add(Request(request_id, text, token_ids, params, [seq], time.perf_counter()))

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks return at once. False if it is unknown or done."""
        request = self.output_processor.pop(request_id)
        if request is None:
            return False
        self.scheduler.abort([s.seq_id for s in request.seqs])
        return True

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise `RequestRejectedError` if such a request could never be served (reads only the frozen config)."""
        self.scheduler.check_fits(num_prompt_tokens, max_tokens, n)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def queue_sizes(self) -> QueueSizes:
        """Requests (not sequences) waiting, running and swapped out."""
        scheduler = self.scheduler
        return QueueSizes(*(len({seq.request_id for seq in queue})
                            for queue in (scheduler.waiting, scheduler.running, scheduler.swapped)))

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
        self._step_sent = False
        try:
            return self._step()
        except EngineDeadError:
            raise
        except Exception as error:
            if self.executor is None or not self._step_sent:
                raise  # no group, or it failed before the workers heard of this step: the ranks are in step
            # Under tensor parallelism a step that failed once sent (a collective that timed out, a peer
            # that broke its connection) leaves the ranks out of step: nothing can run after it.
            cause = self.executor.dead_worker()  # the cause, when a worker died
            self._fail(cause or f"tensor-parallel step failed: {type(error).__name__}: {str(error)[:400]}")
            raise EngineDeadError(self._dead) from error

    def _step(self) -> list[RequestOutput]:
        io = self._held_disk_io()
        with io.holding_writes() if io is not None else contextlib.nullcontext():  # but in the device wait
            return self._run_step()

    def _held_disk_io(self):
        """The disk tier's `DiskIO` whose writes the step loop holds while it runs Python (see kv_disk); None
        without KV tiers or under `kv_offload_disk_writes_during_steps`."""
        offload = self.runner.offload
        return None if offload is None or self.config.kv_offload_disk_writes_during_steps else offload.io

    def _run_step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        previous = self._in_flight
        if previous is not None and not self._can_overlap():
            outputs += self._complete(previous)
            self._in_flight = previous = None
        self._settle_tiers()  # disk reads done since the last step: their prompts may be admitted now
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        step_input = self.input_builder.build(out, self.output_processor.seq_to_request, self._num_samples(out),
                                              previous_rows=previous.rows if previous is not None else None)
        built = time.perf_counter()
        previous_tokens = previous.result.device_tokens if previous is not None and previous.result else None
        if self.executor is not None:
            self._check_workers()
            self._step_sent = True  # from here on a failure leaves the workers' step behind (see step)
            self.executor.send(step_input)
        try:
            result = self.runner.execute(step_input, previous_tokens)  # block moves run even in an empty step
        except Exception as error:
            if self.executor is not None:
                raise  # the ranks are out of step: `step` stops the engine
            # The step still in flight fed this one its tokens on the device: its requests go down with it.
            raise self._step_failed(error, out, previous.out if previous is not None else None) from error
        self._settle_tiers()
        current = _InFlight(out, step_input, result, self.scheduler.advance(out))
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
        return self.config.async_scheduling and self.output_processor.num_sync_requests == 0

    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens, resolve them in the scheduler and report what moved."""
        waiting = time.perf_counter()
        io = self._held_disk_io()
        with io.writes_running() if io is not None else contextlib.nullcontext():  # while the host waits
            if self.executor is not None and flight.result is not None:
                # A peer that died or stopped answering leaves this step's collectives waiting forever on the
                # device: the executor watches the workers and gives the step `distributed_timeout_s`.
                broken = self.executor.wait(flight.result, self.config.distributed_timeout_s)
                if broken is not None:
                    self._fail(broken)
                    raise EngineDeadError(self._dead)
            try:  # the one device read of the step: an error here is the step's, not one request's
                token_ids = flight.result.token_ids() if flight.result is not None else []
                logprobs = flight.result.logprobs() if flight.result is not None and any(
                    row.params.logprobs is not None for row in flight.step_input.sampling) else None
            except Exception as error:
                raise self._step_failed(error, flight.out) from error
        sampled = self.output_processor.unpack(flight.step_input, flight.out, token_ids, logprobs)
        flight.wait_s = time.perf_counter() - waiting
        finished = flight.length_finished + self.scheduler.resolve(flight.out, sampled)
        return self.output_processor.process(flight.out, sampled, finished)

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
                    and item.end == seq.num_tokens and len(self.requests[seq.request_id].seqs) == 1:
                wanted[seq.seq_id] = seq.sampling_params.n
        return wanted

    # ------------------------------------------------------------------ tensor parallel
    def _check_workers(self) -> None:
        """Raise `EngineDeadError` (failing every request) if a spawned worker has died."""
        if self._dead is None and (exit_message := self.executor.dead_worker()):
            self._fail(exit_message)
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _fail(self, reason: str) -> None:
        self._dead = reason
        logger.error("engine stopped: %s", reason)
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None

    # ------------------------------------------------------------------ KV tiers
    def _index_disk(self) -> None:
        """Index the disk tier's files (a restart finds its prefixes), or turn the tier off if it cannot run."""
        tiers = self.scheduler.block_manager.tiers
        if tiers is not None and tiers.disk is not None:
            if self.runner.offload is None:
                tiers.disable_disk("no host pool")
            else:
                self.runner.offload.index_disk(tiers)

    def _settle_tiers(self) -> None:
        """Tell the KV tiers' bookkeeping what the runner's disk reads and writes found."""
        tiers = self.scheduler.block_manager.tiers
        if tiers is not None and self.runner.offload is not None:
            self.runner.offload.settle(tiers)

    def persist_kv(self) -> None:
        """Write every cached block not on disk yet, so a restart on the same directory finds them (no-op
        without a disk tier; `shutdown` calls it, and so does the server when it stops)."""
        offload = self.runner.offload
        if offload is None or offload.disk is None:
            return
        if self._in_flight is not None:
            self._complete(self._in_flight)
            self._in_flight = None
        bm = self.scheduler.block_manager
        from_device, from_host = bm.persist()
        disk = bm.tiers.disk if bm.tiers is not None else None
        step = StepInput(persist=from_device, persist_host=from_host,
                         persist_order=disk.keys() if disk is not None else [],  # the disk's LRU, for a restart
                         disk_deletes=bm.take_tier_copies().disk_deletes)  # deletes: what the size cap evicted
        if self.executor is not None:  # every rank writes its own shard of the same blocks
            if self.executor.dead_worker() is not None:
                return
            self.executor.send(step)
        self.runner.execute(step)
        offload.close()

    def shutdown(self) -> None:
        """Write the KV tiers' blocks to disk (if a disk tier is on), stop tensor-parallel workers and leave
        the group (idempotent)."""
        if self._dead is None and getattr(self, "runner", None) is not None:
            self.persist_kv()
        if self.executor is not None:
            self.executor.shutdown(self.runner, broken=self._dead is not None)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> EngineStats:
        """Blocks, preemptions, swaps, prefix-cache hits and throughput so far."""
        bm = self.scheduler.block_manager
        st = self.scheduler.stats
        cache = bm.prefix_cache
        processor = self.output_processor
        return EngineStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size, num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks, peak_used_blocks=bm.allocator.peak_used,
            num_preemptions=st.num_preemptions, num_swap_outs=st.num_swap_outs, num_swap_ins=st.num_swap_ins,
            num_rejected=st.num_rejected, num_request_failures=processor.num_request_failures,
            prefix_cache_queries=cache.num_queries if cache else 0, prefix_cache_hits=cache.num_hits if cache else 0,
            prefix_cache_hit_tokens=bm.num_prefix_hit_tokens, num_prompt_tokens=processor.num_prompt_tokens,
            num_generated_tokens=processor.num_generated_tokens, num_steps=st.num_steps, busy_seconds=self._busy,
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict:
        """The KV tiers' fields of `EngineStats` (none without a host pool)."""
        tiers = self.scheduler.block_manager.tiers
        offload = self.runner.offload
        return offload.stats_fields(tiers) if tiers is not None and offload is not None else {}

    def latest_stats(self) -> EngineStats:
        """`stats()`: one engine's are always at hand."""
        return self.stats()

    def health(self) -> None:
        """None: one engine has no replicas to report."""
        return None

    def check_integrity(self) -> None:
        """Assert the scheduler's queues and blocks agree (tests call this)."""
        self.scheduler.check_integrity()
