"""The FlashInfer anchor of `pagedkv bench kernel`, on CPU, against a stand-in `flashinfer` module.

The stand-in implements the two wrappers' plan/run from FlashInfer's CSR page tables alone
(it never sees pagedkv's block tables), in float32: so a wrong conversion of the tables, a
wrong scale or a dropped causal flag makes its output miss the float64 reference, and the
section reports that contender as failed instead of timing it. What this cannot check is the
real FlashInfer's API on a GPU: that runs only where FlashInfer is installed.
"""

import json
import math
import sys
import types

import pytest
import torch

from pagedkv.bench import kernel_flashinfer


class _Wrapper:
    """FlashInfer's paged wrappers as far as the bench uses them: NHD pages, CSR tables, scalar FP8 scales."""

    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        if backend == "fa3":
            raise RuntimeError("fa3 needs sm_90")  # a contender that cannot run: reported, the rest go on
        self.backend = backend

    def plan(self, *args, causal=False, q_data_type=None, kv_data_type=None, sm_scale=None):
        if len(args) == 8:  # prefill: qo_indptr first
            self.qo_indptr, args = args[0], args[1:]
        else:
            self.qo_indptr = None
        self.indptr, self.indices, self.last, self.heads, self.kv_heads, _, self.page = args
        self.causal, self.scale = causal, sm_scale

    def run(self, q, kv, out=None, k_scale=None, v_scale=None):
        k_cache, v_cache = kv
        for b in range(len(self.indptr) - 1):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]].long()
            length = (len(pages) - 1) * self.page + int(self.last[b])
            k = k_cache[pages].flatten(0, 1)[:length].float() * (k_scale or 1.0)
            v = v_cache[pages].flatten(0, 1)[:length].float() * (v_scale or 1.0)
            rows = slice(b, b + 1) if self.qo_indptr is None else slice(int(self.qo_indptr[b]),
                                                                          int(self.qo_indptr[b + 1]))
            group = self.heads // self.kv_heads
            scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k.repeat_interleave(group, 1)) * self.scale
            if self.causal:
                num_q = scores.shape[1]
                visible = torch.arange(length)[None, :] <= torch.arange(length - num_q, length)[:, None]
                scores = scores.masked_fill(~visible, -math.inf)
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1)).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(__version__="0.0-stand-in", BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
                                   BatchPrefillWithPagedKVCacheWrapper=_Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def test_anchor_times_every_case_beside_flashinfer(fake_flashinfer, tmp_path, monkeypatch):
    from pagedkv.bench.kernel import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # pagedkv's torch path: the interpreter takes minutes
    assert main(["--smoke", "--flashinfer-only", "--out", str(tmp_path)]) == 0
    section = json.loads((tmp_path / "kernel_flashinfer.json").read_text())["flashinfer"]
    assert section["version"] == "0.0-stand-in"
    kinds = [row["kind"] for row in section["rows"]]
    assert kinds == ["decode", "prefill", "prefill", "fp8 decode"]
    for row in section["rows"]:
        for name, result in row["contenders"].items():
            if name == "flashinfer fa3":
                assert result["us"] is None and "fa3 needs sm_90" in result["error"]
            else:
                assert result["error"] == "" and result["us"] > 0, (row["case"], name, result)
        assert row["best_flashinfer"] != "flashinfer fa3" and row["speed_ratio"] > 0
    header, body = kernel_flashinfer.table_rows(section)
    assert len(body) == 4 and "pagedkv / FlashInfer" in header
    assert "## pagedkv beside FlashInfer" in kernel_flashinfer.markdown(section)[0]


def test_a_wrong_page_table_is_caught_not_timed(fake_flashinfer, monkeypatch):
    real = kernel_flashinfer.csr_tables

    def off_by_one(block_tables, seq_lens):
        indptr, indices, last = real(block_tables, seq_lens)
        return indptr, indices.roll(1), last

    monkeypatch.setattr(kernel_flashinfer, "csr_tables", off_by_one)
    monkeypatch.setattr(kernel_flashinfer, "SMOKE", {"decode": [(2, 64)], "prefill": [], "fp8": []})
    section = kernel_flashinfer.anchor(torch.device("cpu"), torch.float32, "torch", True, lambda message: None)
    decode = section["rows"][0]["contenders"]
    assert decode["pagedkv"]["us"] > 0
    assert decode["flashinfer tensor-core"]["us"] is None
    assert "against float64" in decode["flashinfer tensor-core"]["error"]


def test_without_flashinfer_the_section_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    messages = []
    section = kernel_flashinfer.anchor(torch.device("cpu"), torch.float32, "torch", True, messages.append)
    assert section["rows"] == [] and section["version"] is None
    assert "FlashInfer not importable" in section["note"] and messages == [section["note"]]
    assert section["note"] in kernel_flashinfer.markdown(section)
