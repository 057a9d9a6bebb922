"""Beyond one GPU: tensor-parallel groups over torch.distributed and the worker loop of ranks > 0.

The data-parallel router lives in `pagedkv.engine.router`; replicas are whole engines.
"""

from pagedkv.distributed.parallel import (
    ParallelConfig,
    TensorParallel,
    all_reduce_mode_from_env,
    launched_by_torchrun,
)

__all__ = ["ParallelConfig", "TensorParallel", "all_reduce_mode_from_env", "launched_by_torchrun"]
