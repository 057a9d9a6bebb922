"""Beyond one engine: tensor parallelism and data-parallel replicas.

    parallel.py       a tensor-parallel group over torch.distributed (NCCL, gloo on CPU): collectives
    executor.py       rank 0's handle on the group, and the loop of ranks > 0 (a model runner each)
    data_parallel.py  N whole engines, one process each, behind the router
    router.py         the routing policy (prefix-aware, least-loaded, round-robin): pure Python, shared
                      by the data-parallel engine and `pagedkv sim --cluster`

The package imports nothing heavy itself, so the pure-Python router can be used without torch.
"""
