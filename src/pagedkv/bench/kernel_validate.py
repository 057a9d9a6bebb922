"""Validation for `pagedkv bench kernel`: every named contender against the float64 reference before timing.

The named decode schedules and tunings, the prefill and unified tunings and the split kernel
(the engine's prefill call) run on full-size cases (small ones on CPU) and are compared with
the float64 reference. A contender that fails any case is reported and left out of timing.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    chunk_kv,
    decode_contenders,
    describe,
    make_paged,
    max_abs_err,
    tolerance_for,
)


def validate(device, dtype, backend: str, decode_tunings: dict, prefill_tunings: dict,
             unified_tunings: dict) -> list[dict]:
    """Every named contender vs the float64 reference on full-size cases; one row per (contender, case)."""
    import torch

    from pagedkv.kernels import (
        KernelWorkspace,
        paged_attention,
        paged_decode_attention,
        paged_prefill_attention,
        reference_decode_attention,
        reference_prefill_attention,
    )

    rows, scale, tolerance = [], HEAD_DIM ** -0.5, tolerance_for(dtype)
    workspace = KernelWorkspace(8 * NUM_KV_HEADS, device)

    def record(kernel, contender, case, call, expected):
        try:
            err, error = max_abs_err(call(), expected), ""
        except Exception as failure:  # noqa: BLE001 - reported as a failed contender
            err, error = float("inf"), describe(failure)
        rows.append({"kernel": kernel, "contender": contender, "case": case, "max_abs_err": err,
                     "ok": err <= tolerance, "tolerance": tolerance, "error": error})

    cases = [(8, 4096, 16), (1, 32768, 16), (4, 4096, 128)] if device.type == "cuda" else [(2, 300, 16)]
    for index, (batch, seq_len, page) in enumerate(cases):
        query, k_cache, v_cache, table, _ = make_paged(batch, seq_len, page, True, device, dtype, seed=1)
        lens = torch.tensor([max(1, seq_len - 977 * i) for i in range(batch)], dtype=torch.int32, device=device)
        expected = reference_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, float64=True)
        # The first case checks every tuning; the others the schedules the grid times.
        tunings = {**decode_contenders(), **decode_tunings} if index == 0 else decode_contenders()
        for name, tuning in tunings.items():
            record("decode", name, f"B={batch} L<={seq_len} page={page}", functools.partial(
                paged_decode_attention, query, k_cache, v_cache, table, lens, scale=scale, max_seq_len=seq_len,
                backend=backend, tuning=tuning, workspace=workspace), expected)
    q_lens, seq_lens = [2048, 512, 1], [2048, 3000, 1000]
    if device.type != "cuda":
        q_lens, seq_lens = [64, 5, 1], [64, 100, 30]
    query, k_cache, v_cache, table, _ = make_paged(len(q_lens), max(seq_lens), 16, True, device, dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    expected = reference_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
    case = f"q_lens={q_lens} seq_lens={seq_lens} page=16"
    for kernel, call, tunings in (("prefill", paged_prefill_attention, prefill_tunings),
                                  ("unified", paged_attention, unified_tunings)):
        for name, tuning in tunings.items():
            record(kernel, name, case, functools.partial(call, query, k_cache, v_cache, table, lens, cu, scale=scale,
                                                         max_seqlen_q=max(q_lens), backend=backend, tuning=tuning),
                   expected)
    key, value = chunk_kv(k_cache, v_cache, table, seq_lens, q_lens)  # the engine's call: the split kernel
    record("prefill", "split", case, functools.partial(paged_prefill_attention, query, k_cache, v_cache, table, lens,
                                                       cu, scale=scale, max_seqlen_q=max(q_lens), backend=backend,
                                                       key=key, value=value), expected)
    workspace.check_integrity()
    return rows


def failed_contenders(rows: list[dict]) -> set[tuple[str, str]]:
    """(kernel, contender) pairs that failed any validation case: the timing sections skip them."""
    return {(row["kernel"], row["contender"]) for row in rows if not row["ok"]}
