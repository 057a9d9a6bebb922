"""Engine-shaped kernel cases for `pagedkv bench kernel`: what one engine step actually asks of attention.

- Engine shapes: decode (and a small prefill) with the models the engine runs: Qwen3-0.6B
  (16 q / 8 kv heads, d128), SmolLM2-135M (9 / 3, d64), GPT-2 (12 / 12, d64).
- Chunked prefill: a 512-token chunk on a cached 4,096-token prefix (Llama-3-8B attention).
- Mixed step: 200 decode rows plus one 512-token chunk, as one unified launch against
  separate decode and prefill launches (both captured in one CUDA graph).

Each case builds its data once, computes the float64 reference once, checks every contender
against it, and times only those that pass (CUDA-graph replays). Each section returns a
printable table (`header`, `body`, `note`) and its rows.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    LLAMA3,
    chunk_kv,
    contiguous_sdpa,
    decode_contenders,
    describe,
    fmt,
    kv_bytes,
    make_paged,
    max_abs_err,
    sdpa_flash_causal,
    tbps,
    tolerance_for,
    try_time_graphed,
    unified_variant_tunings,
)

#: Model -> (q heads, kv heads, head_dim) of the engine's models.
ENGINE_MODELS = {"Qwen3-0.6B": (16, 8, 128), "SmolLM2-135M": (9, 3, 64), "GPT-2": (12, 12, 64)}


def make_step(seq_lens: list[int], q_lens: list[int], page: int, device, dtype, heads=LLAMA3, seed: int = 0):
    """A shuffled pool holding sequences of `seq_lens` tokens, and a query of `q_lens` new tokens each.

    Returns (query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q).
    """
    import torch

    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-n // page) for n in seq_lens]
    shape = (sum(blocks), page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(sum(blocks), generator=generator)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for row, num in enumerate(blocks):
        table[row, :num] = order[start : start + num]
        start += num
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    return (query, k_cache, v_cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), cu)


def _contest(contenders: dict, expected, dtype, device, invalid: set) -> dict:
    """name -> {"ms", "error", "max_abs_err"}: each contender (kernel, name, call) checked, then timed if right."""
    results = {}
    for name, (kernel, tuning_name, call) in contenders.items():
        if (kernel, tuning_name) in invalid:
            results[name] = {"ms": None, "error": "failed validation", "max_abs_err": None}
            continue
        try:
            err = max_abs_err(call(), expected) if expected is not None else 0.0
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            results[name] = {"ms": None, "error": describe(error), "max_abs_err": None}
            continue
        if err > tolerance_for(dtype):
            results[name] = {"ms": None, "error": f"wrong: max abs err {err:.1e}", "max_abs_err": err}
            continue
        ms, error = try_time_graphed(call, device)
        results[name] = {"ms": ms, "error": error, "max_abs_err": err}
    return results


def _cell(result: dict, value) -> str:
    return fmt(value, ".2f", (result["error"] or "n/a")[:28])


# --------------------------------------------------------------------------- engine shapes
def engine_shapes(device, dtype, backend: str, smoke: bool, copy_tbps: float, invalid: set, progress) -> dict:
    """Decode of each engine model at a few (batch, context) shapes, and a small prefill: TB/s and TFLOP/s."""
    import torch
    import torch.nn.functional as F

    from pagedkv.kernels import (
        KernelWorkspace,
        paged_attention,
        paged_decode_attention,
        paged_prefill_attention,
        reference_decode_attention,
        reference_prefill_attention,
    )

    decode_shapes = [(1, 8192), (8, 2048), (64, 512)] if not smoke else [(1, 128), (4, 64)]
    prefill_batch, prefill_len = (4, 1024) if not smoke else (1, 64)
    names = list(decode_contenders())
    header = ["model", "case", *[f"{name}" for name in names], "SDPA", "best % copy"]
    body, rows = [], []
    for model, heads in ENGINE_MODELS.items():
        workspace = KernelWorkspace(64 * heads[1], device)
        scale = heads[2] ** -0.5
        for batch, seq_len in decode_shapes:
            query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, 16, True, device, dtype, seed=5,
                                                              heads=heads)
            expected = reference_decode_attention(query, k_cache, v_cache, table, lens, scale=scale, float64=True)
            contenders = {name: ("decode", name, functools.partial(
                paged_decode_attention, query, k_cache, v_cache, table, lens, scale=scale, max_seq_len=seq_len,
                validate=False, backend=backend, tuning=tuning, workspace=workspace))
                for name, tuning in decode_contenders().items()}
            results = _contest(contenders, expected, dtype, device, invalid)
            sdpa_ms, _ = try_time_graphed(contiguous_sdpa(query, k_cache, v_cache, table, seq_len), device)
            num_bytes = kv_bytes(batch, seq_len, k_cache.element_size(), heads)
            rates = {name: tbps(num_bytes, r["ms"]) for name, r in results.items()}
            best = max(rates.values(), key=lambda rate: rate or 0.0)
            rows.append({"model": model, "kind": "decode", "batch": batch, "seq_len": seq_len, "tbps": rates,
                         "errors": {n: r["error"] for n, r in results.items()}, "sdpa_tbps": tbps(num_bytes, sdpa_ms),
                         "best_copy_fraction": best / copy_tbps if best else None})
            body.append([model, f"decode B={batch} x {seq_len} (TB/s)", *[_cell(results[n], rates[n]) for n in names],
                         fmt(tbps(num_bytes, sdpa_ms)), fmt(best and 100 * best / copy_tbps, ".0f")])
            progress(f"engine shape {model} decode B={batch} L={seq_len}: "
                     + ", ".join(f"{n} {fmt(rates[n])}" for n in names))
        # A small prefill of fresh prompts: prefill kernel vs unified kernel vs SDPA (TFLOP/s).
        q_lens = [prefill_len] * prefill_batch
        query, k_cache, v_cache, table, lens, cu = make_step(q_lens, q_lens, 16, device, dtype, heads, seed=6)
        expected = reference_prefill_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
        common = (query, k_cache, v_cache, table, lens, cu)
        options = {"scale": scale, "max_seqlen_q": prefill_len, "validate": False, "backend": backend}
        results = _contest({
            "prefill kernel": ("prefill", "default", functools.partial(paged_prefill_attention, *common, **options)),
            "unified kernel": ("unified", "unified m64", functools.partial(paged_attention, *common, **options)),
        }, expected, dtype, device, invalid)
        num_heads, num_kv_heads, head_dim = heads
        q = query.view(prefill_batch, prefill_len, num_heads, head_dim).transpose(1, 2)
        k = k_cache[table.long()].view(prefill_batch, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        v = v_cache[table.long()].view(prefill_batch, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        sdpa_ms, _ = try_time_graphed(sdpa_flash_causal(q, k, v)[0], device) if device.type == "cuda" else \
            try_time_graphed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device)
        flops = prefill_batch * 2 * 2 * num_heads * head_dim * prefill_len**2 / 2

        def tflops(ms, flops=flops):
            return flops / (ms * 1e-3) / 1e12 if ms else None

        rows.append({"model": model, "kind": "prefill", "batch": prefill_batch, "seq_len": prefill_len,
                     "tflops": {n: tflops(r["ms"]) for n, r in results.items()}, "sdpa_tflops": tflops(sdpa_ms)})
        body.append([model, f"prefill {prefill_batch} x {prefill_len} (TFLOP/s)",
                     _cell(results["prefill kernel"], tflops(results["prefill kernel"]["ms"])),
                     _cell(results["unified kernel"], tflops(results["unified kernel"]["ms"])),
                     *["" for _ in names[2:]], fmt(tflops(sdpa_ms), ".1f"), ""])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    note = ("decode rows: TB/s of each decode schedule (page 16, shuffled); prefill rows: TFLOP/s of the prefill "
            "kernel (first column) and the unified kernel (second column)")
    return {"header": header, "body": body, "rows": rows, "note": note}


# --------------------------------------------------------------------------- chunked prefill
def chunked_prefill(device, dtype, backend: str, smoke: bool, invalid: set, progress) -> dict:
    """A 512-token chunk on a cached 4,096-token prefix: TFLOP/s of each kernel and of masked SDPA."""
    import torch
    import torch.nn.functional as F

    from pagedkv.kernels import paged_attention, paged_prefill_attention, reference_paged_attention

    chunk, prefix = (512, 4096) if not smoke else (32, 64)
    num_heads, num_kv_heads, head_dim = LLAMA3
    seq_len = prefix + chunk
    query, k_cache, v_cache, table, lens, cu = make_step([seq_len], [chunk], 16, device, dtype, seed=7)
    scale = head_dim ** -0.5
    expected = reference_paged_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
    common = (query, k_cache, v_cache, table, lens, cu)
    options = {"scale": scale, "max_seqlen_q": chunk, "max_seq_len": seq_len, "validate": False, "backend": backend}
    key, value = chunk_kv(k_cache, v_cache, table, [seq_len], [chunk])
    contenders = {"split kernel (engine)": ("prefill", "split", functools.partial(
                      paged_prefill_attention, *common, **options, key=key, value=value)),
                  "prefill kernel": ("prefill", "default",
                                     functools.partial(paged_prefill_attention, *common, **options))}
    unified = unified_variant_tunings()
    for name in ("unified m64", "unified m128 w8", "unified m32"):
        contenders[name] = ("unified", name, functools.partial(paged_attention, *common, **options,
                                                               tuning=unified[name]))
    results = _contest(contenders, expected, dtype, device, invalid)
    # SDPA has no bottom-right causal flag: an explicit mask on contiguous K/V expanded to the q heads.
    k = k_cache[table[0].long()].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = v_cache[table[0].long()].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()  # [1, H, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous()
    q = query.transpose(0, 1)[None]  # [1, H, chunk, D]
    mask = torch.arange(seq_len, device=device)[None, :] <= torch.arange(prefix, seq_len, device=device)[:, None]
    results["SDPA (explicit mask)"] = dict(zip(("ms", "error"), try_time_graphed(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), device)), max_abs_err=None)
    flops = 2 * 2 * num_heads * head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)
    rows = [{"contender": name, "ms": r["ms"], "error": r["error"], "max_abs_err": r["max_abs_err"],
             "tflops": flops / (r["ms"] * 1e-3) / 1e12 if r["ms"] else None} for name, r in results.items()]
    progress(f"chunked prefill {chunk} on {prefix}: " + ", ".join(f"{r['contender']} {fmt(r['tflops'], '.0f')}"
                                                                   for r in rows))
    body = [[r["contender"], fmt(r["ms"] and r["ms"] * 1e3, ".1f", (r["error"] or "n/a")[:40]),
             fmt(r["tflops"], ".1f")] for r in rows]
    return {"header": ["contender", "time us", "TFLOP/s"], "body": body, "rows": rows,
            "note": f"one {chunk}-token chunk on a cached {prefix}-token prefix, Llama-3-8B attention, page 16"}


# --------------------------------------------------------------------------- mixed step
def mixed_step(device, dtype, backend: str, smoke: bool, invalid: set, progress) -> dict:
    """200 decode rows + one 512-token chunk: the unified kernel (one launch) vs decode + prefill launches."""
    import torch

    from pagedkv.kernels import (
        KernelWorkspace,
        paged_attention,
        paged_decode_attention,
        paged_prefill_attention,
        reference_paged_attention,
    )

    num_decode, chunk, prefix, low, high = (200, 512, 4096, 512, 2048) if not smoke else (8, 32, 64, 16, 64)
    generator = torch.Generator().manual_seed(8)
    decode_lens = torch.randint(low, high, (num_decode,), generator=generator).tolist()
    seq_lens, q_lens = [*decode_lens, prefix + chunk], [1] * num_decode + [chunk]
    query, k_cache, v_cache, table, lens, cu = make_step(seq_lens, q_lens, 16, device, dtype, seed=9)
    scale = HEAD_DIM ** -0.5
    expected = reference_paged_attention(query, k_cache, v_cache, table, lens, cu, scale=scale, float64=True)
    workspace = KernelWorkspace(num_decode * LLAMA3[1], device)
    out = torch.empty_like(query)
    chunk_cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    options = {"scale": scale, "validate": False, "backend": backend}

    def unified_call(tuning):
        return functools.partial(paged_attention, query, k_cache, v_cache, table, lens, cu, max_seqlen_q=chunk,
                                 max_seq_len=max(seq_lens), out=out, tuning=tuning, workspace=workspace, **options)

    def separate_call(decode_tuning):
        def run():
            paged_decode_attention(query[:num_decode], k_cache, v_cache, table[:num_decode], lens[:num_decode],
                                   max_seq_len=high, out=out[:num_decode], tuning=decode_tuning, workspace=workspace,
                                   **options)
            paged_prefill_attention(query[num_decode:], k_cache, v_cache, table[num_decode:], lens[num_decode:],
                                    chunk_cu, max_seqlen_q=chunk, out=out[num_decode:], **options)
            return out
        return run

    unified = unified_variant_tunings()
    contenders = {f"one launch: {name}": ("unified", name, unified_call(unified[name]))
                  for name in ("unified m64", "unified m16", "unified m32", "unified m128 w8")}
    for name, tuning in decode_contenders().items():
        contenders[f"two launches: decode ({name}) + prefill"] = ("decode", name, separate_call(tuning))
    results = _contest(contenders, expected, dtype, device, invalid)
    num_bytes = kv_bytes(1, sum(seq_lens), k_cache.element_size())
    rows = [{"contender": name, "ms": r["ms"], "error": r["error"], "max_abs_err": r["max_abs_err"],
             "tbps": tbps(num_bytes, r["ms"]), "launches": 1 if name.startswith("one") else 2}
            for name, r in results.items()]
    progress("mixed step: " + ", ".join(f"{r['contender']} {fmt(r['ms'] and r['ms'] * 1e3, '.1f')} us"
                                        for r in rows))
    body = [[r["contender"], fmt(r["ms"] and r["ms"] * 1e3, ".1f", (r["error"] or "n/a")[:40]), fmt(r["tbps"])]
            for r in rows]
    note = (f"{num_decode} decode rows (context {low}-{high}) + one {chunk}-token chunk on a {prefix}-token prefix, "
            f"Llama-3-8B attention, page 16; TB/s = K/V bytes the step reads / time")
    return {"header": ["contender", "time us", "K/V TB/s"], "body": body, "rows": rows, "note": note}


def _best(rows: list[dict], launches: int) -> dict | None:
    timed = [r for r in rows if r.get("launches") == launches and r["ms"]]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def run_steps(device, dtype, backend: str, smoke: bool, copy_tbps: float, invalid: set, progress):
    """All three sections; returns ({title: section}, [target rows for the summary])."""
    import torch

    steps, targets = {}, []
    for title, key, run in (
            ("Engine shapes", "engine_shapes", lambda: engine_shapes(device, dtype, backend, smoke, copy_tbps,
                                                                     invalid, progress)),
            ("Chunked prefill", "chunked_prefill", lambda: chunked_prefill(device, dtype, backend, smoke, invalid,
                                                                           progress)),
            ("Mixed step", "mixed_step", lambda: mixed_step(device, dtype, backend, smoke, invalid, progress))):
        try:
            steps[key] = run()
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            steps[key] = {"header": ["error"], "body": [[describe(error)]], "rows": [], "note": f"{title} failed"}
            progress(f"{title} failed: {describe(error)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mixed = steps["mixed_step"]["rows"]
    one, two = _best(mixed, 1), _best(mixed, 2)
    if one and two:
        targets.append({"target": "mixed step: one unified launch no slower than decode + prefill launches",
                        "met": one["ms"] <= two["ms"],
                        "measured": f"{one['ms'] * 1e3:.1f} us ({one['contender']}) vs {two['ms'] * 1e3:.1f} us "
                                    f"({two['contender']}), {two['ms'] / one['ms']:.2f}x"})
    for row in steps["chunked_prefill"]["rows"]:
        if row["tflops"] and not row["contender"].startswith("SDPA"):
            targets.append({"target": f"chunked prefill (report): {row['contender']}", "met": None,
                            "measured": f"{row['tflops']:.0f} TFLOP/s"})
    for row in steps["engine_shapes"]["rows"]:
        if row["kind"] == "decode" and row["best_copy_fraction"]:
            targets.append({"target": f"engine {row['model']} decode B={row['batch']} x {row['seq_len']} (report)",
                            "met": None, "measured": f"{100 * row['best_copy_fraction']:.0f}% of copy"})
    return steps, targets
