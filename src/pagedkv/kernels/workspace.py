"""Scratch that split-KV kernels keep between calls: arrival counters that reset themselves.

The kernels that merge split partials inside the launch (`DecodeTuning(merge="in_kernel")`)
count each (sequence, kv head)'s finished parts on an int32 counter,
and the last part to arrive stores 0 back (see `triton_common`). A counter buffer zeroed
once therefore stays zero after every call: a decode step needs no memset launch, and a
CUDA graph that captured the step replays it as is.

Without a workspace the launchers allocate fresh zeros per call: correct, one memset more.
The buffer has a fixed capacity because a captured graph holds its address: growing it
would leave the graph pointing at freed memory. One workspace per stream: two launches in
flight at once must not share counters.
"""

from __future__ import annotations

import torch

from pagedkv.errors import KernelInputError, require_positive_int


class KernelWorkspace:
    """`max_items` self-resetting int32 counters on `device` (one per sequence x kv head of a step)."""

    def __init__(self, max_items: int, device: str | torch.device):
        require_positive_int("max_items", max_items)
        self.max_items = max_items
        self._counters = torch.zeros(max_items, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        """Where the counters live."""
        return self._counters.device

    def counters(self, num_items: int) -> torch.Tensor:
        """The first `num_items` counters (all zero between kernel launches)."""
        if num_items > self.max_items:
            raise KernelInputError(f"the step needs {num_items} split counters (sequences x kv heads), over the "
                                   f"workspace's max_items = {self.max_items}")
        return self._counters[:num_items]

    def check_integrity(self) -> None:
        """Every counter is back to zero (reads the device; for tests, never on a hot path)."""
        busy = int(torch.count_nonzero(self._counters))
        assert busy == 0, f"{busy} split counters were left non-zero by a kernel"
