"""Turning logits into tokens: one batched pass on the device for every row of a step.

    raw logits ─┬─ log_softmax ──────────────────────────────────── logprobs (the model's own
                │                                                   distribution, as vLLM reports)
                └─ penalties → logit_bias → min_tokens mask ─┬─ greedy rows: argmax
                                                             └─ random rows: / temperature
                                                                → top-k → top-p → inverse CDF

Randomness is counter-based, so there is no generator state to keep, release or restore. Each
(seed, sample index) pair owns a splitmix64 stream whose state is `stream_keys(seed, index)`;
the uniform behind a sequence's t-th output token is that stream's value number t + 1, computed
directly on the host with numpy's wrapping uint64 arithmetic. One uniform per sample picks the
token by inverse CDF over the row's float64 weights in vocabulary order. A draw is therefore a
pure function of (logits, params, seed, sample index, outputs so far): it does not depend on the
rest of the batch, a recomputed sequence draws the same tokens, and CPU and CUDA agree up to
float64 rounding (cumulative sums within ~1e-16, so a token differs with probability ~1e-11).

NOTE: one uniform per sample, not a noise value per (row, token) as in Gumbel-max: the random
numbers cost O(samples) host work instead of O(rows x vocab) integer hashing on the device.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.env import env_choice
from pagedkv.errors import InvalidArgumentError, require_positive_int
from pagedkv.kernels.host_store import store_to_host

logger = logging.getLogger(__name__)

#: How a step's results reach the host on CUDA: "kernel" stores them into pinned memory from the SMs (not
#: queued behind KV copies to the host on the copy engine, `pagedkv.kernels.host_store`); "copy" is a
#: non-blocking copy. PAGEDKV_RESULTS_TO_HOST switches it for comparison.
RESULTS_TO_HOST = ("kernel", "copy")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's state increment


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, a bijection of uint64 (numpy arrays wrap on overflow and shift logically)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_keys(seeds: Sequence[int], sample_indices: Sequence[int]) -> np.ndarray:
    """The splitmix64 state of each (seed, sample index) stream: mix(mix(seed mod 2**64) ^ index).

    mix is a bijection, so one seed's indices, and one index's seeds, never share a key.
    """
    seeds = np.array([seed % 2**64 for seed in seeds], dtype=np.uint64)
    return _mix64(_mix64(seeds) ^ np.asarray(sample_indices, dtype=np.uint64))


def uniforms(seeds: Sequence[int], sample_indices: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """The uniform in [0, 1) (53 bits) behind output number `counter` of each (seed, sample index) stream."""
    steps = np.asarray(counters, dtype=np.uint64) + np.uint64(1)
    values = _mix64(stream_keys(seeds, sample_indices) + steps * _GOLDEN)
    return (values >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample from; plain data the runner builds per step."""

    params: SamplingParams
    seed: int  # the request's stream seed (its own, or one the engine drew for it)
    sample_indices: tuple[int, ...]  # (k,) usually; (0, ..., n-1) for the first token of an n > 1 request
    num_output_tokens: int  # outputs so far: the counter of each sample's stream
    prompt_token_ids: Sequence[int] = ()  # read only when params.needs_history
    output_token_ids: Sequence[int] = ()


def _upload(parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy float64 host arrays to `device` in one transfer (pinned on CUDA); return views by name."""
    flat = torch.from_numpy(np.concatenate([part.ravel() for part in parts.values()]).astype(np.float64))
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    views, start = {}, 0
    for name, part in parts.items():
        views[name] = flat[start:start + part.size].view(part.shape)
        start += part.size
    return views


def _pairs(rows_and_ids: list[tuple[int, Iterable[int]]]) -> np.ndarray:
    """[2, n] (row, token id) pairs from each row's token ids."""
    ids = [np.asarray(token_ids, dtype=np.float64).ravel() for _, token_ids in rows_and_ids]
    counts = [len(t) for t in ids]
    return np.stack([np.repeat([float(row) for row, _ in rows_and_ids], counts),
                     np.concatenate(ids) if ids else np.zeros(0)])


@dataclass
class _Step:
    """One step's parameters: host-side shapes, and the device views of what `_pack` uploaded.

    `tensors` has only the parts some row needs ("penalties", "bias", "banned" may be absent).
    """

    num_samples: list[int]
    logprobs_ks: list[int | None]
    has_greedy: bool
    random_rows: torch.Tensor | None  # [num_random] rows that draw at random
    tensors: dict[str, torch.Tensor]


def _pack(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: tuple[int, ...],
          device: torch.device) -> _Step:
    """Everything the device needs for a step, built in one pass over the rows and sent in one copy."""
    width = max(len(row.sample_indices) for row in rows)
    random, temperature, streams, filtered, top_k, top_p = [], [], [], [], [], []
    history, bias, stops = [], [], []
    for i, row in enumerate(rows):
        params = row.params
        if not params.is_greedy:
            if params.top_k > 0 or params.top_p < 1:
                filtered.append(len(random))
                top_k.append(min(params.top_k, vocab_size) if params.top_k > 0 else vocab_size)
                top_p.append(params.top_p)
            random.append(i)
            temperature.append(params.temperature)
            # Pad to `width` samples with the row's first stream; padded draws are discarded.
            indices = tuple(row.sample_indices) + (row.sample_indices[0],) * (width - len(row.sample_indices))
            streams += [(row.seed, index, row.num_output_tokens) for index in indices]
        if params.needs_penalties:
            if params.needs_history:
                history.append(i)
            bias += [(i, token, value) for token, value in params.logit_bias or () if token < vocab_size]
            if row.num_output_tokens < params.min_tokens:  # may not stop yet: mask stop tokens (and EOS)
                stops.append((i, params.stop_token_ids + (() if params.ignore_eos else eos_token_ids)))
    parts = {
        "random_rows": np.array(random, dtype=np.float64),
        "uniforms": uniforms(*zip(*streams)).reshape(len(random), width) if streams else np.zeros((0, width)),
        "temperature": np.array(temperature, dtype=np.float64),
        "filtered": np.array(filtered, dtype=np.float64),
        "top_k": np.array(top_k, dtype=np.float64),
        "top_p": np.array(top_p, dtype=np.float64),
    }
    if history:
        parts["penalties"] = np.array([(row.params.presence_penalty, row.params.frequency_penalty,
                                        row.params.repetition_penalty) for row in rows])  # [rows, 3]
        parts["outputs"] = _pairs([(i, rows[i].output_token_ids) for i in history])
        parts["prompts"] = _pairs([(i, rows[i].prompt_token_ids) for i in history])
    if bias:
        parts["bias"] = np.array(bias, dtype=np.float64).T  # [3, n]: row, token, bias
    banned = _pairs(stops) if stops else np.zeros((2, 0))
    if (banned[1] < vocab_size).any():
        parts["banned"] = banned[:, banned[1] < vocab_size]
    tensors = _upload(parts, device)
    return _Step([len(row.sample_indices) for row in rows], [row.params.logprobs for row in rows],
                 has_greedy=len(random) < len(rows),
                 random_rows=tensors["random_rows"].long() if 0 < len(random) < len(rows) else None,
                 tensors=tensors)


def _adjust(logits: torch.Tensor, step: _Step) -> torch.Tensor:
    """Penalties, then logit_bias, then the min_tokens mask, out of place ([rows, vocab], float32).

    NOTE: bias after penalties (vLLM adds it before), so -100 bans and +100 forces whatever the
    penalties did. Every fill value is made on the device: a host scalar tensor would sync the stream.
    """
    t = step.tensors
    if "penalties" in t:
        presence, frequency, repetition = t["penalties"].float().T[:, :, None]  # each [rows, 1]
        out_rows, out_tokens = t["outputs"].long()
        ones = torch.ones_like(out_rows, dtype=logits.dtype)
        counts = torch.zeros_like(logits).index_put_((out_rows, out_tokens), ones, accumulate=True)
        prompt_rows, prompt_tokens = t["prompts"].long()
        seen = (counts > 0).index_put((prompt_rows, prompt_tokens), torch.ones_like(prompt_rows, dtype=torch.bool))
        # HF's repetition penalty: shrink positive logits, push negative ones further down.
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits) - frequency * counts - presence * (counts > 0)
    if "bias" in t:
        bias_rows, bias_tokens, values = t["bias"]
        logits = logits.index_put((bias_rows.long(), bias_tokens.long()), values.float(), accumulate=True)
    if "banned" in t:
        banned_rows, banned_tokens = t["banned"].long()
        logits = logits.index_put((banned_rows, banned_tokens), logits.new_full(banned_rows.shape, float("-inf")))
    return logits


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf what top-k, then top-p, drop from each row of `x` ([rows, vocab]).

    top_k = vocab and top_p = 1 leave a row bit-for-bit unchanged.
    """
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # stable: ties break the same on every device
    kth = sorted_x.gather(1, top_k[:, None] - 1)
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # ties with the k-th stay, as in vLLM
    probs = sorted_x.softmax(-1)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))


def _draw(logits: torch.Tensor, step: _Step) -> torch.Tensor:
    """Tokens [random rows, width] by inverse CDF, from adjusted logits of the random rows ([rows, vocab])."""
    t = step.tensors
    x = logits.double() / t["temperature"][:, None]
    if t["filtered"].numel():
        filtered = t["filtered"].long()
        x = x.index_copy(0, filtered, _top_k_top_p(x.index_select(0, filtered), t["top_k"].long(), t["top_p"]))
    cdf = (x - x.amax(-1, keepdim=True)).exp_().cumsum_(-1)  # [rows, vocab], unnormalized
    # A zero-weight token never follows cdf[i - 1] <= target < cdf[i], so masked tokens are never drawn.
    targets = t["uniforms"] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).clamp_(max=logits.shape[-1] - 1)


class SamplerOutput:
    """One step's sampled tokens (and logprobs), on their way to the host in one copy."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None, num_samples: list[int],
                 logprobs_ks: list[int | None], device_tokens: torch.Tensor | None = None):
        # The first sample of each row, still on the device: the next step's inputs under async scheduling.
        self.device_tokens = device_tokens
        # [rows, width] tokens; when some row wants logprobs, then [rows, width] sampled logprobs,
        # [rows, k] top values and [rows, k] top ids (k the largest asked for). All float64.
        self._host = host
        self._event = event
        self._num_samples = num_samples
        self._logprobs_ks = logprobs_ks
        self._values: list[list[float]] | None = None

    def _rows(self) -> list[list[float]]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values

    def ready(self) -> bool:
        """Whether the results have reached the host (reading them will not wait)."""
        return self._event is None or self._event.query()

    def token_ids(self) -> list[list[int]]:
        """Per row, one token per sample index (waits for the copy)."""
        return [[int(v) for v in row[:n]] for row, n in zip(self._rows(), self._num_samples)]

    def logprobs(self) -> list[list[TokenLogprobs | None]]:
        """Per row and sample, the token's logprobs, or None where the row's params.logprobs is None."""
        width = max(self._num_samples, default=0)
        top_k = max((k for k in self._logprobs_ks if k is not None), default=0)
        out = []
        for row, n, k in zip(self._rows(), self._num_samples, self._logprobs_ks):
            if k is None:
                out.append([None] * n)
                continue
            values, ids = row[2 * width:2 * width + top_k], row[2 * width + top_k:]
            top = [(int(ids[i]), values[i]) for i in range(k)]
            out.append([TokenLogprobs(int(row[j]), row[width + j], top) for j in range(n)])
        return out


class Sampler:
    """Samples every row of a step's logits in one batched pass; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str, eos_token_ids: Iterable[int] = ()):
        self.vocab_size = require_positive_int("vocab_size", vocab_size)
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.results_to_host = env_choice("PAGEDKV_RESULTS_TO_HOST", RESULTS_TO_HOST, "kernel")
        # (event, pinned tensor) of results still being stored: a kernel's stores, unlike a copy, do not
        # tell the pinned-memory allocator when they end, so the tensor is kept here until its event has
        # completed, even if its SamplerOutput is dropped unread.
        self._storing: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def _check(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape != (len(rows), self.vocab_size):
            raise InvalidArgumentError(f"logits must be [{len(rows)} rows, {self.vocab_size} vocab], "
                                       f"got {tuple(logits.shape)}")
        if any(not row.sample_indices for row in rows):
            raise InvalidArgumentError("every SamplingRow needs at least one sample index")

    @torch.inference_mode()
    def adjusted_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The float32 logits after penalties, logit_bias and the min_tokens mask (what greedy rows argmax)."""
        self._check(logits, rows)
        return _adjust(logits.float(), _pack(rows, self.vocab_size, self.eos_token_ids, self.device))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample `rows` from `logits` ([rows, vocab], any float dtype, on the device).

        Returns at once; the results reach pinned host memory asynchronously (one kernel, or one copy), and
        `SamplerOutput` waits for them.
        """
        self._check(logits, rows)
        if not rows:
            return SamplerOutput(torch.zeros(0, 0, dtype=torch.float64), None, [], [])
        if all(row.params.is_greedy and not row.params.needs_penalties and row.params.logprobs is None
               for row in rows):
            # Plain greedy (the common serving case): one argmax on the logits as they are (a bf16 -> fp32
            # cast is exact, so the first maximum is the same), no per-row packing, one copy back.
            width = max(len(row.sample_indices) for row in rows)
            tokens = logits.argmax(-1, keepdim=True)
            return self._send(tokens.expand(-1, width).contiguous(), [len(row.sample_indices) for row in rows],
                              [None] * len(rows), tokens[:, 0])
        step = _pack(rows, self.vocab_size, self.eos_token_ids, self.device)
        raw = logits.float()
        adjusted = _adjust(raw, step)
        width = max(step.num_samples)
        if step.random_rows is None and step.has_greedy:  # all greedy; greedy is the argmax, first max on ties
            tokens = adjusted.argmax(-1, keepdim=True).expand(-1, width)
        elif step.random_rows is None:  # all random
            tokens = _draw(adjusted, step)
        else:
            tokens = adjusted.argmax(-1, keepdim=True).expand(-1, width).clone()
            tokens.index_copy_(0, step.random_rows, _draw(adjusted.index_select(0, step.random_rows), step))
        parts = [tokens.double()]  # token ids are exact in float64
        ks = [k for k in step.logprobs_ks if k is not None]
        if ks:
            logprobs = raw.log_softmax(-1)
            top = logprobs.topk(max(ks), dim=-1)
            parts += [logprobs.gather(1, tokens).double(), top.values.double(), top.indices.double()]
        return self._send(torch.cat(parts, dim=1), step.num_samples, step.logprobs_ks, tokens[:, 0])

    def _send(self, result: torch.Tensor, num_samples: list[int], logprobs_ks: list, device_tokens: torch.Tensor):
        """Start moving a step's results to pinned host memory (one kernel or one copy, an event to wait on)."""
        event = None
        if result.is_cuda:
            while self._storing and self._storing[0][0].query():
                self._storing.popleft()
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            stored = self.results_to_host == "kernel" and self._store(result, host)
            if not stored:
                host.copy_(result, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            if stored:
                self._storing.append((event, host))
            result = host
        return SamplerOutput(result, event, num_samples, logprobs_ks, device_tokens=device_tokens)

    def _store(self, result: torch.Tensor, host: torch.Tensor) -> bool:
        """Store `result` into `host` by a kernel; False (and copies from then on) where the device cannot."""
        try:
            store_to_host(result.contiguous(), host, validate=False)
        except Exception as error:  # noqa: BLE001 - e.g. pinned memory not mapped for the device: copy instead
            logger.warning("storing step results to pinned host memory from a kernel failed (%s); copying them "
                           "instead", error)
            self.results_to_host = "copy"
            return False
        return True
