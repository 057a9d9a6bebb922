"""FlashInfer as `pagedkv bench kernel`'s standing anchor: its paged decode and prefill on pagedkv's own pool.

FlashInfer is a contender here and nothing else: it is imported inside these functions only,
and where it does not import the section says so (with the reason) and the bench goes on.
Where it imports, each case builds one pool (NHD pages of 16 tokens, shuffled block tables)
and hands the very same K/V tensors to both libraries:

    decode        B x L: pagedkv's default schedule; FlashInfer's tensor-core and CUDA-core decode
    prefill       8 x 2048 causal and a 512-token chunk on a 4,096 prefix: pagedkv's engine call
                  (the split kernel, given the chunks' K/V); FlashInfer's fa2 and fa3 backends
    FP8 decode    e4m3 K/V, bf16 query: pagedkv's FP8 default; FlashInfer's FP8 decode (both kinds)

Every contender is first checked against the float64 reference on the case's data and is
timed only if it passes, the way the rest of the bench times: `do_bench` median of a one-call
CUDA graph, L2 flushed (a FlashInfer call that cannot be captured is timed as plain calls, and
its row says so). Each row reports pagedkv / FlashInfer as a speed ratio: FlashInfer's best
time over pagedkv's, so above 1 means pagedkv is faster. FlashInfer's version is recorded.

Page tables. FlashInfer reads CSR tables; pagedkv's `[num_seqs, max_blocks]` tables and lengths map as

    indptr[b + 1]     = indptr[b] + ceil(seq_len_b / page)
    indices           = block_tables[b, :ceil(seq_len_b / page)], b = 0, 1, ...
    last_page_len[b]  = seq_len_b - page * (ceil(seq_len_b / page) - 1)        (1 .. page)

FP8. FlashInfer scales all of K (and all of V) by one float, pagedkv per KV head. The FP8 cases
quantize with one scale per cache and give pagedkv that value in every head's slot, so both
read identical bytes with identical scales.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    chunk_kv,
    describe,
    fmt,
    make_paged,
    max_abs_err,
    tolerance_for,
    try_time,
    try_time_graphed,
)

#: The issue table's cases: (batch, context length) decode; (name, batch, chunk, prefix) prefill.
DECODE_CASES = [(1, 32768), (8, 4096), (64, 512), (64, 4096), (256, 512)]
PREFILL_CASES = [("prefill 8 x 2048 causal", 8, 2048, 0), ("chunk 512 on 4096", 1, 512, 4096)]
FP8_CASES = [(64, 4096), (1, 32768)]
SMOKE = {"decode": [(2, 64)], "prefill": [("prefill 2 x 64 causal", 2, 64, 0), ("chunk 16 on 48", 1, 16, 48)],
         "fp8": [(2, 64)]}
PAGE = 16


def _workspace(device):
    """FlashInfer's float workspace: 256 MiB on a GPU (what its examples allocate), 1 MiB for a CPU stand-in."""
    import torch

    return torch.zeros(256 * 2**20 if device.type == "cuda" else 2**20, dtype=torch.uint8, device=device)


def import_flashinfer():
    """(module, "") or (None, why it is not there)."""
    try:
        import flashinfer
    except Exception as error:  # noqa: BLE001 - absent, or present but broken: either way no anchor
        return None, describe(error)
    return flashinfer, ""


def csr_tables(block_tables, seq_lens):
    """(indptr, indices, last_page_len), int32 on the tables' device: FlashInfer's view of pagedkv's tables."""
    import torch

    lengths = seq_lens.tolist()
    pages = [-(-n // PAGE) for n in lengths]
    device = block_tables.device
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    indices = torch.cat([block_tables[b, :num] for b, num in enumerate(pages)]).to(torch.int32)
    last = torch.tensor([n - PAGE * (num - 1) if num else 0 for n, num in zip(lengths, pages)], dtype=torch.int32,
                        device=device)
    return indptr, indices, last


def flashinfer_decode(fi, query, k_cache, v_cache, block_tables, seq_lens, scale, tensor_cores: bool,
                      k_scale: float | None = None, v_scale: float | None = None):
    """A closure running FlashInfer's paged decode (planned once, here) into a fixed output."""
    import torch

    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(query.device), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(*csr_tables(block_tables, seq_lens), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                 q_data_type=query.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
    out = torch.empty_like(query)
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    return functools.partial(wrapper.run, query, (k_cache, v_cache), out=out, **scales)


def flashinfer_prefill(fi, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, backend: str):
    """A closure running FlashInfer's causal paged prefill on `backend` ("fa2" or "fa3")."""
    import torch

    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(query.device), "NHD", backend=backend)
    wrapper.plan(cu_seqlens_q, *csr_tables(block_tables, seq_lens), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                 causal=True, q_data_type=query.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
    out = torch.empty_like(query)
    return functools.partial(wrapper.run, query, (k_cache, v_cache), out=out)


def _time(name: str, make, expected, dtype, device) -> dict:
    """{"us", "error", "method"}: build the contender, check it against `expected`, then time it."""
    try:
        call = make()
        err = max_abs_err(call(), expected)
    except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
        return {"us": None, "error": describe(error), "method": ""}
    if err > tolerance_for(dtype):
        return {"us": None, "error": f"max abs err {err:.1e} against float64", "method": ""}
    ms, error = try_time_graphed(call, device)
    method = "graph"
    if ms is None and name.startswith("flashinfer"):  # some FlashInfer launches refuse capture
        ms, error = try_time(call, device)
        method = "plain calls"
    return {"us": ms * 1e3 if ms else None, "error": error, "method": method}


def _row(kind: str, case: str, contenders: dict) -> dict:
    """One case: each contender's result, FlashInfer's best, and pagedkv / FlashInfer as a speed ratio."""
    ours = contenders["pagedkv"]["us"]
    theirs = {name: r["us"] for name, r in contenders.items() if name != "pagedkv" and r["us"]}
    best = min(theirs, key=theirs.get) if theirs else None
    return {"kind": kind, "case": case, "contenders": contenders, "best_flashinfer": best,
            "speed_ratio": theirs[best] / ours if best and ours else None}


def _quantize_one_scale(k_cache, v_cache):
    """(k8, v8, k_scales, v_scales, k_scale, v_scale): e4m3 caches with one scale per cache, repeated per head."""
    import torch

    from pagedkv.kernels.fp8 import DEFAULT_HEADROOM, fp8_max, quantize

    dtype = torch.float8_e4m3fn
    top = fp8_max(dtype) / DEFAULT_HEADROOM
    k_scale, v_scale = float(k_cache.abs().max()) / top, float(v_cache.abs().max()) / top
    shape, heads = k_cache.shape, k_cache.shape[2]
    k_scales = torch.full((heads,), k_scale, dtype=torch.float32, device=k_cache.device)
    v_scales = torch.full((heads,), v_scale, dtype=torch.float32, device=k_cache.device)
    k8 = quantize(k_cache.reshape(-1, heads, shape[-1]), k_scales, dtype).view(shape)
    v8 = quantize(v_cache.reshape(-1, heads, shape[-1]), v_scales, dtype).view(shape)
    return k8, v8, k_scales, v_scales, k_scale, v_scale


def anchor(device, dtype, backend: str, smoke: bool, progress) -> dict:
    """The FlashInfer section: {"version", "note", "rows"} (no rows, and the reason, without FlashInfer)."""
    import torch

    from pagedkv.kernels import (
        paged_decode_attention,
        paged_prefill_attention,
        reference_decode_attention,
        reference_prefill_attention,
    )

    fi, why = import_flashinfer()
    if fi is None:
        note = f"FlashInfer not importable ({why}): no FlashInfer columns this run"
        progress(note)
        return {"version": None, "note": note, "rows": []}
    version = str(getattr(fi, "__version__", "unknown"))
    progress(f"FlashInfer {version}: the anchor section")
    scale = HEAD_DIM ** -0.5
    cases = SMOKE if smoke else {"decode": DECODE_CASES, "prefill": PREFILL_CASES, "fp8": FP8_CASES}
    rows = []
    for batch, seq_len in cases["decode"]:
        query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, PAGE, True, device, dtype, seed=13)
        expected = reference_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, float64=True)
        contenders = {"pagedkv": _time("pagedkv", lambda: functools.partial(
            paged_decode_attention, query, k_cache, v_cache, table, lens, scale=scale, max_seq_len=seq_len,
            validate=False, backend=backend), expected, dtype, device)}
        for name, cores in (("flashinfer tensor-core", True), ("flashinfer cuda-core", False)):
            contenders[name] = _time(name, lambda cores=cores: flashinfer_decode(
                fi, query, k_cache, v_cache, table, lens, scale, cores), expected, dtype, device)
        rows.append(_row("decode", f"B={batch} x {seq_len}", contenders))
        progress(f"FlashInfer anchor, decode B={batch} x {seq_len}: pagedkv/FlashInfer "
                 f"{fmt(rows[-1]['speed_ratio'])}x")
    for case, batch, chunk, prefix in cases["prefill"]:
        seq_len = prefix + chunk
        _, k_cache, v_cache, table, lens = make_paged(batch, seq_len, PAGE, True, device, dtype, seed=14)
        query = torch.randn(batch * chunk, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
        cu = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device)
        key, value = chunk_kv(k_cache, v_cache, table, [seq_len] * batch, [chunk] * batch)
        expected = reference_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
        contenders = {"pagedkv": _time("pagedkv", lambda: functools.partial(
            paged_prefill_attention, query, k_cache, v_cache, table, lens, cu, scale=scale, max_seqlen_q=chunk,
            max_seq_len=seq_len, validate=False, backend=backend, key=key, value=value), expected, dtype, device)}
        for fi_backend in ("fa2", "fa3"):
            contenders[f"flashinfer {fi_backend}"] = _time(f"flashinfer {fi_backend}", lambda b=fi_backend: (
                flashinfer_prefill(fi, query, k_cache, v_cache, table, lens, cu, scale, b)), expected, dtype, device)
        flops = batch * 2 * 2 * NUM_HEADS * HEAD_DIM * (chunk * prefix + chunk * (chunk + 1) / 2)
        for result in contenders.values():
            result["tflops"] = flops / (result["us"] * 1e-6) / 1e12 if result["us"] else None
        rows.append(_row("prefill", case, contenders))
        progress(f"FlashInfer anchor, {case}: pagedkv/FlashInfer {fmt(rows[-1]['speed_ratio'])}x")
    for batch, seq_len in cases["fp8"]:
        query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, PAGE, True, device, dtype, seed=15)
        k8, v8, k_scales, v_scales, k_scale, v_scale = _quantize_one_scale(k_cache, v_cache)
        expected = reference_decode_attention(query, k8, v8, table, lens, scale=scale, float64=True,
                                              k_scale=k_scales, v_scale=v_scales)
        contenders = {"pagedkv": _time("pagedkv", lambda: functools.partial(
            paged_decode_attention, query, k8, v8, table, lens, scale=scale, max_seq_len=seq_len, validate=False,
            backend=backend, k_scale=k_scales, v_scale=v_scales), expected, dtype, device)}
        for name, cores in (("flashinfer tensor-core", True), ("flashinfer cuda-core", False)):
            contenders[name] = _time(name, lambda cores=cores: flashinfer_decode(
                fi, query, k8, v8, table, lens, scale, cores, k_scale, v_scale), expected, dtype, device)
        rows.append(_row("fp8 decode", f"B={batch} x {seq_len}", contenders))
        progress(f"FlashInfer anchor, FP8 decode B={batch} x {seq_len}: pagedkv/FlashInfer "
                 f"{fmt(rows[-1]['speed_ratio'])}x")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"version": version, "note": "", "rows": rows}


def table_rows(section: dict) -> tuple[list[str], list[list[str]]]:
    """(header, body): one row per case, pagedkv beside FlashInfer's best, for the console and the markdown."""
    header = ["kind", "case", "pagedkv", "FlashInfer best", "pagedkv / FlashInfer", "notes"]
    body = []
    for row in section["rows"]:
        best = row["best_flashinfer"]
        cells = []
        for result in (row["contenders"]["pagedkv"], row["contenders"][best] if best else {"us": None}):
            cells.append(f"{fmt(result.get('tflops'), '.0f')} TFLOP/s" if row["kind"] == "prefill"
                         else f"{fmt(result['us'], '.1f')} us")
        notes = [f"{name}: {r['error'][:60]}" for name, r in row["contenders"].items() if r["error"]]
        notes += [f"{name} timed as plain calls" for name, r in row["contenders"].items()
                  if r.get("method") == "plain calls"]
        body.append([row["kind"], row["case"], cells[0], f"{cells[1]} ({best or 'n/a'})",
                     f"{fmt(row['speed_ratio'])}x", "; ".join(notes)])
    return header, body


def markdown(section: dict) -> list[str]:
    """The section as markdown lines (the reason only, without FlashInfer)."""
    lines = ["## pagedkv beside FlashInfer", ""]
    if not section["rows"]:
        return lines + [section["note"] or "No FlashInfer rows.", ""]
    header, body = table_rows(section)
    lines += [f"FlashInfer {section['version']}, same pool (page 16, shuffled), same method; pagedkv / FlashInfer "
              f"= FlashInfer's best time over pagedkv's (above 1: pagedkv faster).", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines + [""]
