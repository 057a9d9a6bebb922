"""`KVOffload.move`: a step that restores a block it also spills fills the host block before reading it back.

On CUDA the in-step restores are staged from the host before the spills are issued (beside the step before), so
this step must issue its spills first (`reads_a_spill`); on the CPU every copy runs in order anyway.
"""

from types import SimpleNamespace

import pytest
import torch

from pagedkv.core.block_table import BlockCopy
from pagedkv.engine.kv_offload import KVOffload

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _step(**copies):
    fields = ("persist", "persist_host", "disk_loads", "swap_out", "offload", "swap_in", "restore_in_step",
              "restore", "pre_offload", "disk_writes", "disk_deletes")
    return SimpleNamespace(**{name: copies.get(name, []) for name in fields})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["restore_in_step", "restore"])
def test_a_block_spilled_and_restored_in_one_step_comes_back_whole(device, where):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    storage = torch.randn((2, 3, 8, 4, 2, 16), device=device)  # [2, L, N, B, Hkv, D]
    offload = KVOffload(SimpleNamespace(device=storage.device, kv_storage=storage), 4)
    offload.host.zero_()
    spilled = storage[:, :, 2].clone()
    # GPU block 2 spills into host block 1; host block 1 is restored into GPU block 5; another pair rides along.
    offload.move(_step(offload=[BlockCopy(2, 1), BlockCopy(3, 0)], **{where: [BlockCopy(1, 5)]}))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(storage[:, :, 5], spilled)
    assert torch.equal(offload.host[1], spilled)
    offload.close()
