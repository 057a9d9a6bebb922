"""How `bench serve` paces requests, and one benchmark from a config: arrivals, concurrency, one run per rate.

Arrivals follow vLLM's bench: gaps between requests are gamma-distributed with shape
`burstiness` and mean 1/rate (burstiness 1.0 is a Poisson process; below 1 burstier, above 1
more even); rate `inf` sends everything at once. `max_concurrency` then caps how many are in
flight: an arrived request waits for a slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Awaitable, Callable

import httpx
from tqdm import tqdm

from pagedkv.bench.serve import datasets
from pagedkv.bench.serve.client import OpenAIClient, measure_loop_lag
from pagedkv.bench.serve.metrics import RequestRecord, client_overhead, summarize
from pagedkv.errors import InvalidArgumentError

DATASETS = ("random", "sharegpt", "prefix-chat", "ids")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the run's start) of `num_requests`: the first at 0, then gamma gaps of mean 1/rate."""
    if not request_rate > 0:
        raise InvalidArgumentError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise InvalidArgumentError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale_s = 1.0 / (request_rate * burstiness)
    offsets, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(burstiness, scale_s)
        offsets.append(now)
    return offsets


@dataclasses.dataclass
class InFlight:
    """How many requests are in flight now, and the most there ever were."""

    num_now: int = 0
    num_max: int = 0


async def run_requests(offsets: list[float], max_concurrency: int | None,
                       send: Callable[[int, float, float], Awaitable[RequestRecord]],
                       on_done: Callable[[RequestRecord], None] | None = None,
                       in_flight: InFlight | None = None) -> tuple[list[RequestRecord], float]:
    """Call `send(index, run_start, dispatch_lag_s)` for every offset at its time, at most `max_concurrency` at once.

    Returns the records in index order and the run's duration (first send to last finish, s).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidArgumentError(f"max concurrency must be >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = in_flight if in_flight is not None else InFlight()
    run_start = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, run_start + offsets[index] - time.perf_counter()))
        if slots is not None:
            await slots.acquire()
        try:
            due = max(run_start + offsets[index], time.perf_counter() if slots is not None else 0.0)
            in_flight.num_now += 1
            in_flight.num_max = max(in_flight.num_max, in_flight.num_now)
            record = await send(index, run_start, max(0.0, time.perf_counter() - due))
        finally:
            in_flight.num_now -= 1
            if slots is not None:
                slots.release()
        if on_done is not None:
            on_done(record)
        return record

    records = await asyncio.gather(*(one(i) for i in range(len(offsets))))
    return list(records), time.perf_counter() - run_start


@dataclasses.dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one `bench serve` invocation needs; `request_rates` gives one run each."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of /v1/models
    endpoint: str = "completions"
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    vocab_size: int = 10_000
    dataset_path: str | None = None  # sharegpt (default: the sample shipped with pagedkv); ids (required)
    sharegpt_output_len: int | None = None
    num_prefixes: int = 4
    prefix_len: int = 256
    num_conversations: int = 16
    num_turns: int = 3
    prompt_format: str = "auto"  # auto: token ids where /v1/completions takes them, else text
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo_ms: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    ignore_eos: bool = False
    stream: bool = True
    progress: bool = True

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise InvalidArgumentError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset == "ids" and not self.dataset_path:
            raise InvalidArgumentError("dataset ids replays a file: give its path (--dataset-path)")
        if self.prompt_format not in ("auto", *datasets.PROMPT_FORMATS):
            raise InvalidArgumentError(f"prompt format must be auto, {', '.join(datasets.PROMPT_FORMATS)}, "
                                       f"got {self.prompt_format!r}")
        if self.num_prompts < 1:
            raise InvalidArgumentError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rates:
            raise InvalidArgumentError("give at least one request rate")
        for rate in self.request_rates:
            arrival_offsets(0, rate, self.burstiness)  # validates rate and burstiness
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidArgumentError(f"max concurrency must be >= 1, got {self.max_concurrency}")

    def requests(self) -> list[datasets.BenchRequest]:
        """The dataset's requests, the same for every rate."""
        if self.dataset == "random":
            return datasets.random_requests(self.num_prompts, self.random_input_len, self.random_output_len,
                                            self.random_range_ratio, self.vocab_size, self.seed)
        if self.dataset == "sharegpt":
            return datasets.sharegpt_requests(self.dataset_path or datasets.sharegpt_path(), self.num_prompts,
                                              self.seed, self.sharegpt_output_len)
        if self.dataset == "ids":
            return datasets.token_id_requests(self.dataset_path, self.num_prompts)
        return datasets.prefix_chat_requests(self.num_prefixes, self.num_conversations, self.num_turns,
                                             self.prefix_len, self.random_input_len, self.random_output_len,
                                             self.random_range_ratio, self.vocab_size, self.seed)


async def _prompt_format(config: ServeBenchConfig, client: OpenAIClient, model: str) -> str:
    if config.endpoint == "chat":
        return "chat"
    if config.prompt_format != "auto":
        return config.prompt_format
    return "ids" if await client.accepts_token_ids(model) else "text"


async def run_benchmark(config: ServeBenchConfig) -> dict:
    """Run the dataset once per request rate against `config.base_url` and return every run's metrics.

    Each run: {"request_rate", "summary" (metrics.summarize), "client" (its overhead),
    "max_in_flight", "requests" (per-request ms and token counts)}.
    """
    requests = config.requests()
    slo = dict(config.slo_ms)
    max_connections = config.max_concurrency or len(requests)
    async with OpenAIClient(config.base_url, config.endpoint, config.api_key, max_connections,
                            stream=config.stream, ignore_eos=config.ignore_eos) as client:
        try:
            model = config.model or await client.served_model()
            prompt_format = await _prompt_format(config, client, model)
            return_token_ids = config.stream and await client.returns_token_ids(model, prompt_format)
        except httpx.HTTPError as error:
            raise InvalidArgumentError(f"cannot reach {config.base_url} ({type(error).__name__}: {error}); "
                                       f"is the server up?") from None
        runs = []
        for rate in config.request_rates:
            offsets = arrival_offsets(len(requests), rate, config.burstiness, config.seed)
            lags_s: list[float] = []
            in_flight = InFlight()
            label = f"rate {rate:g} req/s" if math.isfinite(rate) else "rate inf"

            def send(index: int, run_start: float, dispatch_lag_s: float):
                return client.send(requests[index], index, model, prompt_format, run_start, dispatch_lag_s,
                                   return_token_ids)

            with tqdm(total=len(requests), desc=label, unit="req", disable=not config.progress) as bar:
                monitor = asyncio.ensure_future(measure_loop_lag(lags_s))
                try:
                    records, duration_s = await run_requests(offsets, config.max_concurrency, send,
                                                             on_done=lambda _: bar.update(1), in_flight=in_flight)
                finally:
                    monitor.cancel()
            runs.append({"request_rate": rate if math.isfinite(rate) else "inf",
                         "summary": summarize(records, duration_s, slo),
                         "client": client_overhead(records, lags_s),
                         "max_in_flight": in_flight.num_max,
                         "requests": [_request_row(r) for r in records]})
    return {"model": model, "prompt_format": prompt_format, "return_token_ids": return_token_ids, "runs": runs}


def _request_row(record: RequestRecord) -> dict:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000.0, 3)

    return {"index": record.index, "ok": record.ok, "start_ms": ms(record.start_s), "ttft_ms": ms(record.ttft_s),
            "tpot_ms": ms(record.tpot_s), "e2e_ms": ms(record.e2e_s), "num_prompt_tokens": record.num_prompt_tokens,
            "num_output_tokens": record.num_output_tokens,
            "num_chunks": len(record.itl_s) + (record.ttft_s is not None),
            "error": record.error}
