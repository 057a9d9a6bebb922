"""What every benchmark shares beyond `pagedkv.results`: the CUDA requirement and CUDA-graph timing."""

from __future__ import annotations

from pagedkv.errors import PagedKVError


class GPURequiredError(PagedKVError):
    """A benchmark that measures a CUDA GPU was run where torch sees none (one line, exit 2 via `pagedkv.cli`)."""


def require_cuda(command: str, hint: str = "") -> None:
    """Raise `GPURequiredError` naming `command` (and `hint`, what runs on CPU instead) unless CUDA is available."""
    import torch

    if not torch.cuda.is_available():
        raise GPURequiredError(f"{command} needs a CUDA GPU, and torch.cuda.is_available() is False"
                               + (f"; {hint}" if hint else ""))


def graph_replay_ms(graph, repeats: int = 20) -> float:
    """Median GPU time (ms) of one replay of a captured `torch.cuda.CUDAGraph`, timed with CUDA events."""
    import statistics

    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
