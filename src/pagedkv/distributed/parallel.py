"""Tensor-parallel process groups over `torch.distributed`: NCCL between GPUs, gloo on CPU and for control.

Every rank holds one `TensorParallel`. It wraps two groups over the same ranks:

- the **data group** (NCCL on CUDA, gloo on CPU) for the model's collectives: one all-reduce
  after attention and one after the MLP in every layer, one for the vocab-parallel embedding
  and an all-gather of the LM head's vocab shards. On CUDA these are captured inside the
  decode CUDA graphs like any other kernel;
- the **control group** (gloo, CPU) on which rank 0 broadcasts each step's `StepInput` as a
  pickled object (`broadcast_object_list`), and on which the ranks agree at startup (the pool
  is the smallest rank's). Only rank 0 samples: the step's tokens go to the other ranks as a
  device broadcast on the data group, so the pickled step carries no sampling rows.

`PAGEDKV_TP_ALL_REDUCE=symm_mem` (opt-in, CUDA) replaces NCCL's all-reduce for the model's
activations with torch's symmetric-memory one-shot all-reduce (`torch.ops.symm_mem`): one kernel
copies this rank's partial sums into a buffer every peer can read over NVLink and, after a
barrier, reads all peers' buffers and adds them - the latency-bound path vLLM and sglang take
for decode-sized messages, where NCCL's ring costs ~10 us per call (65 calls per Llama-3-8B
step). It needs no NVLink multicast. It takes bf16 and fp32 messages whose size is a multiple
of 16 bytes, up to 4 MiB with two ranks (a decode step's activations up to batch 512 at width
4096) and 1 MiB with more (`symm_mem_bytes`); anything else, and any setup failure, goes to
NCCL. Rank 0's choice is broadcast, so every rank takes the same path.

Ranks join the way `torchrun` starts them (the `MASTER_ADDR`/`MASTER_PORT`, `RANK`,
`WORLD_SIZE` variables) or the way the engine spawns them (an explicit TCP address), so the
same code runs within a node and across nodes. No transport of pagedkv's own is involved.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedkv.env import env_choice
from pagedkv.errors import ConfigError, EngineDeadError

logger = logging.getLogger("pagedkv")

ALL_REDUCE_MODES = ("nccl", "symm_mem")
#: Dtypes torch's one-shot all-reduce implements (bf16 and fp32; fp16 messages go to NCCL).
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)


def symm_mem_bytes(world_size: int) -> int:
    """Bytes of each symmetric buffer: the largest message the one-shot all-reduce takes.

    Each rank reads every peer's whole message. With two ranks that is the bytes a ring moves
    too, so 4 MiB (a decode step of 512 rows at width 4096 in bf16) still wins on latency; with
    more ranks the reads grow with the peers and NCCL's ring takes over past 1 MiB.
    """
    return 4 * 2**20 if world_size == 2 else 2**20


@dataclass(frozen=True)
class ParallelConfig:
    """How this process joins a tensor-parallel group."""

    tensor_parallel_size: int
    rank: int
    init_method: str  # "env://" (torchrun) or "tcp://host:port"
    device_type: str  # "cuda" or "cpu"
    timeout_s: float = 120.0
    first_device: int = 0  # spawned groups: rank r runs on cuda:(first_device + r) (torchrun: LOCAL_RANK)

    def __post_init__(self):
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(f"rank {self.rank} is outside a tensor-parallel group of {self.tensor_parallel_size}")

    @property
    def local_device(self) -> int:
        """This rank's CUDA device index: torchrun's LOCAL_RANK, else first_device + rank."""
        if self.init_method == "env://" and "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        return self.first_device + self.rank


def all_reduce_mode_from_env() -> str:
    """PAGEDKV_TP_ALL_REDUCE ("nccl", the default, or "symm_mem"); anything else is a `ConfigError`."""
    return env_choice("PAGEDKV_TP_ALL_REDUCE", ALL_REDUCE_MODES, "nccl")


def _symmetric_buffers(device: torch.device, group, world_size: int) -> dict[torch.dtype, torch.Tensor]:
    """One rendezvoused symmetric buffer per activation dtype (made before any graph capture), or {} on failure."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous on older torch
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buffers = {}
        for dtype in SYMM_MEM_DTYPES:
            buffer = symm_mem.empty(symm_mem_bytes(world_size) // dtype.itemsize, dtype=dtype, device=device)
            buffer.zero_()
            symm_mem.rendezvous(buffer, group.group_name)
            buffers[dtype] = buffer
        torch.cuda.synchronize(device)
        return buffers
    except Exception as error:  # noqa: BLE001 - an optional fast path: say why, keep NCCL
        logger.warning("PAGEDKV_TP_ALL_REDUCE=symm_mem unavailable (%s: %s); using NCCL's all-reduce",
                       type(error).__name__, error)
        return {}


def _spawned_group_store(config: ParallelConfig, alive: Callable[[], None] | None) -> dist.TCPStore:
    """The rendezvous store of a spawned group (a tcp:// address), with every rank checked in.

    Rank 0 hosts the store and waits for each worker's check-in key, calling `alive()` (which
    raises when a worker process has died) as it waits. So a worker that dies before it joins
    (an import error, a bad device) fails the startup at once, instead of after the whole
    `timeout_s` that torch's own rendezvous would wait for it.
    """
    address = urlparse(config.init_method)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    size = config.tensor_parallel_size
    store = dist.TCPStore(address.hostname, address.port, size, config.rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if config.rank != 0:
        store.set(f"pagedkv/joined/{config.rank}", "1")
        return store
    keys = [f"pagedkv/joined/{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + config.timeout_s
    while not store.check(keys):
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            missing = [rank for rank in range(1, size) if not store.check([f"pagedkv/joined/{rank}"])]
            raise EngineDeadError(f"tensor-parallel startup: ranks {missing} did not join within "
                                  f"{config.timeout_s:g} s")
        time.sleep(0.01)
    return store


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the env:// variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TensorParallel:
    """This rank's view of the tensor-parallel group (see the module docstring)."""

    def __init__(self, config: ParallelConfig, alive: Callable[[], None] | None = None):
        """`alive` (rank 0 of a spawned group): raises when a worker process has died; called while waiting."""
        self.config = config
        self.rank = config.rank
        self.size = config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # NCCL's watchdog ends the process when a collective outlasts the group's timeout; the engine's
        # own step deadline (timeout_s) must come first, to fail the requests with a clear error.
        data_timeout = 2 * timeout if config.device_type == "cuda" else timeout
        backend = "nccl" if config.device_type == "cuda" else "gloo"
        if config.device_type == "cuda":
            self.device = torch.device("cuda", config.local_device)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            spawned = config.init_method.startswith("tcp://")
            store = _spawned_group_store(config, alive) if spawned else None
            dist.init_process_group(backend, init_method=None if spawned else config.init_method, store=store,
                                    rank=config.rank, world_size=config.tensor_parallel_size, timeout=data_timeout,
                                    device_id=self.device if backend == "nccl" else None)
        self.data_group = dist.group.WORLD
        self.control_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else self.data_group
        mode = all_reduce_mode_from_env()
        if self.size > 1:
            mode = self.broadcast_object(mode)  # rank 0's environment decides for every rank
        self._symm_buffers: dict[torch.dtype, torch.Tensor] = {}
        # Looked up once: one kernel that stages and sums (torch >= 2.8), or None (stage with a copy first).
        self._one_shot_copy_out = getattr(getattr(torch.ops, "symm_mem", None), "one_shot_all_reduce_copy_out", None) \
            if mode == "symm_mem" else None
        if mode == "symm_mem" and backend == "nccl":
            self._symm_buffers = _symmetric_buffers(self.device, self.data_group, self.size)
            if self.min_int(int(bool(self._symm_buffers))) == 0:  # every rank takes the same path, or none
                self._symm_buffers = {}
            elif self.min_int(int(self._symm_mem_sums_right())) == 0:
                logger.warning("PAGEDKV_TP_ALL_REDUCE=symm_mem gave a wrong sum at startup; using NCCL's all-reduce")
                self._symm_buffers = {}
        self.all_reduce_mode = "symm_mem" if self._symm_buffers else backend  # what all_reduce runs on

    def _symm_mem_sums_right(self) -> bool:
        """One small all-reduce per dtype through the symmetric-memory path, checked (every rank runs it)."""
        try:
            want = self.size * (self.size + 1) / 2
            for dtype in self._symm_buffers:
                x = torch.full((64,), float(self.rank + 1), dtype=dtype, device=self.device)
                if not bool((self.all_reduce(x) == want).all()):
                    return False
            return True
        except Exception as error:  # noqa: BLE001 - an optional fast path: say why, keep NCCL
            logger.warning("PAGEDKV_TP_ALL_REDUCE=symm_mem failed at startup (%s: %s)", type(error).__name__, error)
            return False

    # ------------------------------------------------------------------ model collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks; returns the sum (`x` itself, summed in place, on NCCL and gloo)."""
        buffer = self._symm_buffers.get(x.dtype)
        if buffer is not None and x.is_contiguous() and x.numel() <= buffer.numel() \
                and (x.numel() * x.element_size()) % 16 == 0:
            staged = buffer[:x.numel()]
            group = self.data_group.group_name
            copy_out = self._one_shot_copy_out
            if copy_out is not None:  # one kernel stages x into the symmetric buffer and sums (torch >= 2.8)
                out = torch.empty_like(x)  # not x: the kernel may still read x while it writes the sum
                copy_out(staged, x.view(-1), "sum", group, out.view(-1))
                return out
            staged.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group, x.view(-1))
            return x
        dist.all_reduce(x, group=self.data_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] shards from every rank -> [T, size * n], rank-ordered along the last dim."""
        gathered = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        # torch >= 2.13 names it all_gather_single; the GPU machine's torch 2.11 has only the old name.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self.data_group)
        return gathered.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), over the data group."""
        dist.broadcast(x, src=0, group=self.data_group)
        return x

    # ------------------------------------------------------------------ control
    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled over the gloo control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest `value` over all ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def min_ints(self, values: list[int]) -> list[int]:
        """The elementwise smallest of `values` over all ranks (every rank passes as many)."""
        if not values:
            return []
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return t.tolist()

    def abort(self) -> None:
        """Make every collective that waits on a dead peer fail now instead of at the timeout."""
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as error:  # gloo has no abort (its calls fail on a closed peer anyway)
            logger.warning("could not abort the process group: %s", error)

    def shutdown(self) -> None:
        """Destroy the groups. Callers drop CUDA graphs that captured collectives first (see ModelRunner)."""
        self._symm_buffers = {}
        if dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            try:
                dist.destroy_process_group()
            except Exception as error:  # an aborted group may refuse a second teardown
                logger.warning("process group teardown: %s", error)
