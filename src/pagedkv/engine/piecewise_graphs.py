"""Piecewise CUDA graphs: a step with prefill tokens replays everything but attention.

A decode-only step replays one graph of the whole forward (the runner's decode graphs). A step
with prefill chunks cannot: attention's grid and work depend on each sequence's query and KV
lengths. Everything else in the forward (embedding, norms, projections, rotary and the K/V
store, MLP, LM head) depends only on the number of tokens. So for each token-count bucket the
forward is captured as L + 1 graphs, split at each layer's attention call:

    | embed, layer 0 to attention | attn 0 | rest of layer 0, layer 1 to attention | attn 1 | ... | rest of layer L-1, norm, head |
      graph 0                       eager    graph 1                                 eager          graph L

A step of T tokens runs in the smallest bucket B >= T: its T tokens plus B - T padding tokens
(token 0 at position 0, K/V stored to the scratch slot). The eager attention between graphs
sees only the T real rows; the padding rows' outputs are never sampled. The LM head runs over
`min(B, max_num_seqs)` gathered rows, of which the step's sampling rows come first.

How the split works: while a bucket is captured, the model gets a `SplitAttention` in place of
the step's bound attention. Its `forward` ends the current capture, records the layer's q/k/v
(tensors the graphs own, so their addresses stay fixed), begins the next capture, and returns
a static output buffer that the next graph reads. The decoders know nothing of it: any own
decoder that calls `attn.forward` once per layer gets piecewise graphs.

Where the unified attention kernel serves the step (`capture_attention`), attention is captured
too and each bucket is ONE graph: the unified kernel's launch depends only on host ints fixed
per shape (the padded token count and `max_num_seqs`), every sequence is a chunk (a decode row
a chunk of one token), padding sequences have no query tokens and length 0, and the graph
begins by gathering the step's table rows, lengths and query offsets on the device. A step then
costs its staging copy and one replay.

Layer groups (sliding-window models): the graph gathers every group's tables (the same rows of
each group's persistent tables), each layer writes its group's slots, and each layer's
attention reads its group's metadata (`AttentionBackend.layer_meta`), as in an eager step.

On CPU there is nothing to capture; `PiecewiseGraphs(..., capture=False)` runs the same padded
layout eagerly (the forward once per step; attention on the real rows into the static buffer,
or the unified call over the padded metadata), so the padding and row bookkeeping are testable
without a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pagedkv.kernels.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger("pagedkv")

#: How every pagedkv capture treats CUDA calls made during it. "thread_local": only this thread's unsafe
#: calls fail. Under torch's default "global" any thread's synchronize, event query or cudaMalloc during
#: the capture fails there and invalidates the capture: another engine's disk writers in the same process
#: (which wait on CUDA events) broke a second engine's graph capture that way.
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def no_collection_during_capture() -> Iterator[None]:
    """Collect garbage now, then keep Python's collector off until the captures are done.

    A collection that ran inside a capture would free, on the capturing thread, whatever an earlier
    engine left in reference cycles: pinned host blocks, CUDA events. Their release makes CUDA calls
    that thread may not make while it captures, which invalidates the capture (an H200 run saw a
    cuBLAS "internal error" in the first capture after an engine with KV tiers was dropped).

    Nested or concurrent captures (two engines capturing on two threads) share one count: the collector
    comes back on, if it was on, only when the last of them is done."""
    with _capture_lock:
        if _capturing[0] == 0:
            _capturing[1] = gc.isenabled()
            gc.collect()
            gc.disable()
        _capturing[0] += 1
    try:
        yield
    finally:
        with _capture_lock:
            _capturing[0] -= 1
            if _capturing[0] == 0 and _capturing[1]:
                gc.enable()


_capture_lock = threading.Lock()
_capturing = [0, False]  # captures running, and whether the collector was on before the first


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts to capture: steps of 16 to 128, then growing by about 1/4 (32, 64, 128, 256, 512)."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        step = 16 if size < 128 else 32 if size < 256 else 64 if size < 512 else 128 if size < 1024 else \
            256 if size < 2048 else 512
        size += step
    sizes.append(max_tokens)
    return sizes


@dataclass
class AttentionCall:
    """One layer's attention call as the captured graphs left it: the inputs live at fixed addresses."""

    layer_idx: int
    q: torch.Tensor  # [B, H, D]
    k: torch.Tensor | None  # [B, Hkv, D], or None when a fused kernel in the graph stored K/V
    v: torch.Tensor | None
    scale: float
    sliding_window: int | None
    soft_cap: float | None


class SplitAttention:
    """What the model calls instead of the bound attention while one bucket is captured (or emulated).

    mode "capture": each `forward` closes the graph in progress and opens the next;
    mode "warm": each `forward` only returns the buffer (the uncaptured warm-up pass);
    mode "emulate" (CPU): each `forward` runs the step's attention on the real rows, into the buffer;
    mode "unified": each `forward` runs the unified attention over the padded step (captured or not).
    """

    def __init__(self, owner: PiecewiseGraphs, num_tokens: int, mode: str, meta: AttentionMetadata | None = None,
                 num_real_tokens: int = 0):
        self.owner = owner
        self.num_tokens = num_tokens
        self.mode = mode
        self.meta = meta  # "emulate" only: the step's metadata
        self.num_real_tokens = num_real_tokens
        # Group 0's slots, then each further layer group's (sliding-window models): views at fixed addresses.
        self.slot_mappings = [slots[:num_tokens] for slots in (owner.slot_mapping, *owner.group_slot_mappings)]
        self.calls: list[AttentionCall] = []

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                written_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # `written_kv` (the fused kernel's K/V rows in QKV, for the eager split prefill kernel) is not kept:
        # graphed steps read every key from the pool.
        if self.mode == "unified":
            backend = self.owner.backend
            return backend.forward_unified(backend.layer_meta(self.meta, layer_idx), layer_idx, q, k, v, scale=scale,
                                           sliding_window=sliding_window, soft_cap=soft_cap)
        out = self.owner.output_buffer(q)[:self.num_tokens]
        if self.mode == "emulate":
            self.owner.attend(AttentionCall(layer_idx, q, k, v, scale, sliding_window, soft_cap), self.meta,
                              self.num_real_tokens)
        elif self.mode == "warm":
            for name, x in (("q", q), ("k", k), ("v", v)):
                self.owner.allocate_static(name, x)
        elif self.mode == "capture":
            # The graph ends by copying q (and k, v) into buffers shared by every layer and bucket, so the
            # projections' outputs go back to the pool instead of staying alive per layer and bucket.
            q, k, v = (self.owner.static_copy(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
            self.owner.split_capture()
            self.calls.append(AttentionCall(layer_idx, q, k, v, scale, sliding_window, soft_cap))
        return out

    def slot_mapping_for(self, layer_idx: int) -> torch.Tensor:
        """The slots layer `layer_idx` writes: its layer group's."""
        groups = self.owner.backend.layer_groups
        return self.slot_mappings[groups[layer_idx] if groups else 0]

    def kv_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.owner.backend.pool
        return pool.k_caches[layer_idx], pool.v_caches[layer_idx]

    def kv_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.owner.backend.pool.kv_scales(layer_idx)


@dataclass
class BucketGraphs:
    """One bucket's graphs: graphs[i] runs up to attention call i; the last one ends with the logits."""

    graphs: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    logits: torch.Tensor  # [min(B, max_num_seqs), vocab]


class PiecewiseGraphs:
    """The per-bucket piecewise graphs of one model, and how a step runs through them.

    `model(input_ids, positions, attn, logits_indices)` is the own decoder; `input_ids`,
    `positions`, `slot_mapping` and `logits_indices` are the runner's persistent device views
    (the staging layout pads the token rows and the logits rows; see `ModelRunner._stage`).
    """

    def __init__(self, model, backend: AttentionBackend, *, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, logits_indices: torch.Tensor, buckets: list[int], capture: bool = True,
                 capture_attention: bool = False, prepare_replay: Callable[[], None] | None = None,
                 max_num_seqs: int = 0, group_slot_mappings: Sequence[torch.Tensor] = ()):
        self.model = model
        # capture_attention: `prepare_replay()` gathers the step's metadata for all `max_num_seqs` rows on the
        # device (the first op of each graph), and attention is the unified launch over them.
        self.capture_attention = capture_attention
        self.prepare_replay = prepare_replay
        self.max_num_seqs = max_num_seqs
        self.backend = backend
        self.input_ids, self.positions = input_ids, positions
        self.slot_mapping, self.logits_indices = slot_mapping, logits_indices
        self.group_slot_mappings = list(group_slot_mappings)  # layer groups 1.. (sliding-window models)
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        self.max_logit_rows = logits_indices.shape[0]
        self.is_captured = capture
        self._out: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._graphs: dict[int, BucketGraphs] = {}
        self._graph_in_progress: torch.cuda.CUDAGraph | None = None
        self._finished: list[torch.cuda.CUDAGraph] = []
        self._pool = None
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ sizes
    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket holding `num_tokens` (0 if none does: the step runs eagerly)."""
        for size in self.buckets:
            if size >= num_tokens:
                return size
        return 0

    def logit_rows(self, bucket: int) -> int:
        """How many gathered rows the LM head runs over in `bucket`: the staging pads the rest with row 0."""
        return min(bucket, self.max_logit_rows)

    def output_buffer(self, q: torch.Tensor) -> torch.Tensor:
        """The static attention output [max_tokens, H, D] every bucket's graphs read (allocated once, outside them)."""
        if self._out is None:
            self._out = torch.zeros((self.max_tokens, *q.shape[1:]), dtype=q.dtype, device=q.device)
        return self._out

    def static_copy(self, name: str, x: torch.Tensor | None) -> torch.Tensor | None:
        """`x` copied (inside the graph being captured) into the shared static buffer `name`: [:len(x)] of it."""
        if x is None:
            return None
        view = self._static[name][:x.shape[0]]  # allocated by the warm-up pass, outside any capture
        view.copy_(x)
        return view

    def allocate_static(self, name: str, x: torch.Tensor | None) -> None:
        """The shared static buffer `name` for tensors shaped like `x` (the warm-up pass, before any capture)."""
        if x is not None and name not in self._static:
            self._static[name] = torch.empty((self.max_tokens, *x.shape[1:]), dtype=x.dtype, device=x.device)

    # ------------------------------------------------------------------ capture
    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE)
        self._graph_in_progress = graph

    def split_capture(self) -> None:
        """End the graph in progress at an attention call and begin the next one."""
        self._graph_in_progress.capture_end()
        self._finished.append(self._graph_in_progress)
        self._begin()

    @torch.inference_mode()
    @no_collection_during_capture()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        device = self.input_ids.device
        free_before, _ = torch.cuda.mem_get_info(device)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the shared pool settles at its peak
            rows = self.logit_rows(bucket)
            # Warm-up outside any capture: compiles the kernels at this shape and settles cuBLAS workspaces.
            warm_logits = self._forward(bucket, self._attention(bucket, "unified" if self.capture_attention else "warm"))
            if self._logits is None:  # one logits buffer for every bucket, outside the graphs' pool
                self._logits = torch.empty((self.max_logit_rows, warm_logits.shape[1]), dtype=warm_logits.dtype,
                                           device=device)
            del warm_logits
            torch.cuda.synchronize(device)
            split = self._attention(bucket, "unified" if self.capture_attention else "capture")
            self._finished = []
            with torch.cuda.stream(stream):
                self._begin()
                logits = self._logits[:rows]
                # The copy lets the head's own output go back to the shared pool when the capture ends:
                # a [max_num_seqs, vocab] tensor per bucket otherwise (~40 MiB each at 128 x 152k in bf16).
                logits.copy_(self._forward(bucket, split))
                self._graph_in_progress.capture_end()
            stream.synchronize()
            self._graphs[bucket] = BucketGraphs(self._finished + [self._graph_in_progress], split.calls, logits)
            self._graph_in_progress, self._finished = None, []
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        num_graphs = sum(len(b.graphs) for b in self._graphs.values())
        logger.info("captured piecewise CUDA graphs for mixed/prefill steps: %d buckets (%s tokens), %d graphs, "
                    "in %.1f s, %.0f MiB", len(self.buckets), ",".join(map(str, self.buckets)), num_graphs,
                    time.perf_counter() - start, (free_before - free_after) / 2**20)

    # ------------------------------------------------------------------ running a step
    def attend(self, call: AttentionCall, meta: AttentionMetadata, num_tokens: int) -> None:
        """One layer's eager attention over the step's real rows, into the static output buffer."""
        k = call.k[:num_tokens] if call.k is not None else None
        v = call.v[:num_tokens] if call.v is not None else None
        self.backend.forward(self.backend.layer_meta(meta, call.layer_idx), call.layer_idx, call.q[:num_tokens], k, v,
                             scale=call.scale,
                             sliding_window=call.sliding_window, soft_cap=call.soft_cap, out=self._out[:num_tokens])

    @torch.inference_mode()
    def run(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The step's logits [logit_rows(bucket), vocab]; the caller keeps the first num_sample rows.

        The staged inputs must already be padded to `bucket_for(num_tokens)` tokens.
        """
        bucket = self.bucket_for(num_tokens)
        if not self.is_captured:
            if self.capture_attention:
                return self._forward(bucket, self._attention(bucket, "unified"))
            return self._forward(bucket, SplitAttention(self, bucket, "emulate", meta, num_tokens))
        pieces = self._graphs[bucket]
        for graph, call in zip(pieces.graphs, pieces.calls):
            graph.replay()
            self.attend(call, meta, num_tokens)
        pieces.graphs[-1].replay()
        return pieces.logits

    def _attention(self, bucket: int, mode: str) -> SplitAttention:
        if mode != "unified":
            return SplitAttention(self, bucket, mode)
        meta = self.backend.prepare_for_mixed_capture(bucket, self.max_num_seqs, self.slot_mapping,
                                                      self.group_slot_mappings)
        return SplitAttention(self, bucket, mode, meta)

    def _forward(self, bucket: int, attn: SplitAttention) -> torch.Tensor:
        if self.capture_attention:
            self.prepare_replay()
        return self.model(self.input_ids[:bucket], self.positions[:bucket], attn,
                          self.logits_indices[:self.logit_rows(bucket)])

    def release(self) -> None:
        """Drop the graphs (before a tensor-parallel group is destroyed; see `ModelRunner.release_graphs`)."""
        self._graphs.clear()
