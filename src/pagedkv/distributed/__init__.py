"""Beyond one GPU: tensor-parallel groups over torch.distributed and the worker loop of ranks > 0.

The data-parallel router lives in `pagedkv.engine.router`; replicas are whole engines.
"""

from pagedkv.distributed.parallel import ParallelConfig, TensorParallel, launched_by_torchrun

__all__ = ["ParallelConfig", "TensorParallel", "launched_by_torchrun"]
