"""Tensor-parallel process groups over `torch.distributed`: NCCL between GPUs, gloo on CPU and for control.

Every rank holds one `TensorParallel`. It wraps two groups over the same ranks:

- the **data group** (NCCL on CUDA, gloo on CPU) for the model's collectives: one all-reduce
  after attention and one after the MLP in every layer, one for the vocab-parallel embedding
  and an all-gather of the LM head's vocab shards. On CUDA these are captured inside the
  decode CUDA graphs like any other kernel;
- the **control group** (gloo, CPU) on which rank 0 broadcasts each step's `StepInput` as a
  pickled object (`broadcast_object_list`), and on which the ranks agree at startup (the pool
  is the smallest rank's).

Ranks join the way `torchrun` starts them (the `MASTER_ADDR`/`MASTER_PORT`, `RANK`,
`WORLD_SIZE` variables) or the way the engine spawns them (an explicit TCP address), so the
same code runs within a node and across nodes. No transport of pagedkv's own is involved.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedkv.errors import ConfigError

logger = logging.getLogger("pagedkv")


@dataclass(frozen=True)
class ParallelConfig:
    """How this process joins a tensor-parallel group."""

    tensor_parallel_size: int
    rank: int
    init_method: str  # "env://" (torchrun) or "tcp://host:port"
    device_type: str  # "cuda" or "cpu"
    timeout_s: float = 120.0

    def __post_init__(self):
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(f"rank {self.rank} is outside a tensor-parallel group of {self.tensor_parallel_size}")


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the env:// variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TensorParallel:
    """This rank's view of the tensor-parallel group (see the module docstring)."""

    def __init__(self, config: ParallelConfig):
        self.config = config
        self.rank = config.rank
        self.size = config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=config.timeout_s)
        backend = "nccl" if config.device_type == "cuda" else "gloo"
        if config.device_type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", config.rank))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=config.init_method, rank=config.rank,
                                    world_size=config.tensor_parallel_size, timeout=timeout,
                                    device_id=self.device if backend == "nccl" else None)
        self.data_group = dist.group.WORLD
        self.control_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else self.data_group

    # ------------------------------------------------------------------ model collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.data_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] shards from every rank -> [T, size * n], rank-ordered along the last dim."""
        gathered = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        # torch >= 2.13 names it all_gather_single; the GPU machine's torch 2.11 has only the old name.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self.data_group)
        return gathered.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)

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

    def abort(self) -> None:
        """Make every collective that waits on a dead peer fail now instead of at the timeout."""
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as error:  # gloo has no abort (its calls fail on a closed peer anyway)
            logger.warning("could not abort the process group: %s", error)

    def shutdown(self) -> None:
        """Destroy the groups. Callers drop CUDA graphs that captured collectives first (see ModelRunner)."""
        if dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            try:
                dist.destroy_process_group()
            except Exception as error:  # an aborted group may refuse a second teardown
                logger.warning("process group teardown: %s", error)
