"""The decode grid of `pagedkv bench kernel`: paged decode over B x L x page x order against its baselines.

Decode is memory bound, so each case reports achieved bandwidth (K/V bytes read over time)
against the measured copy bandwidth, beside torch's contiguous SDPA on the same data (what
paging must not lose to), gather + SDPA (the naive paged approach) and, where it runs,
FlexAttention's paged attention. Every decode schedule but the default is first checked
against the default's output on the case's data; each row carries the decode targets that
apply to it, printed met or MISSED.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_KV_HEADS,
    contiguous_sdpa,
    decode_contenders,
    describe,
    fmt,
    kv_bytes,
    make_paged,
    max_abs_err,
    tbps,
    tolerance_for,
    try_time,
    try_time_graphed,
)

#: (batch, context length) grid, Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128, bf16.
GRID = [(1, 32768), (8, 4096), (64, 4096), (256, 512), (64, 512)]
SMOKE_GRID = [(1, 256), (4, 64)]
PAGE_SIZES = (16, 128)
#: Small-work decode cases that carry the >= 80% of copy target.
SMALL_WORK = ((1, 32768), (8, 4096), (64, 512))


# --------------------------------------------------------------------------- baselines
def gather_sdpa(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing the naive paged approach: gather pages into contiguous K/V, then SDPA."""
    import torch.nn.functional as F

    batch, q, table = query.shape[0], query.unsqueeze(2), block_tables.long()

    def run():
        k = k_cache[table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
        v = v_cache[table].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def flex_paged(query, k_cache, v_cache, block_tables, seq_len):
    """A closure timing FlexAttention's paged decode (torch.nn.attention.experimental._paged_attention).

    Flex wants its physical cache as [1, Hkv, num_pages * page, D] and a block mask whose kv
    block equals the page, converted from logical to physical pages by `PagedAttention`.
    """
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, page = query.shape[0], k_cache.shape[1]
    num_pages, blocks_per_seq = k_cache.shape[0], block_tables.shape[1]
    paged = PagedAttention(num_pages, page, batch, device=str(query.device))
    table = block_tables.long()
    paged.page_table[:, :blocks_per_seq] = table
    paged.physical_to_logical[torch.arange(batch, device=query.device)[:, None], table] = torch.arange(
        blocks_per_seq, device=query.device)[None, :]
    paged.capacity[:] = blocks_per_seq * page
    k = k_cache.view(1, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()  # [1, Hkv, pages*page, D]
    v = v_cache.view(1, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def causal_free(b, h, q_idx, kv_idx):
        return kv_idx < seq_len

    logical = create_block_mask(causal_free, batch, None, 1, blocks_per_seq * page, device=query.device,
                                BLOCK_SIZE=page)
    physical = paged.convert_logical_block_mask(logical)
    compiled = torch.compile(flex_attention, dynamic=False)
    q = query.unsqueeze(2)
    run = functools.partial(compiled, q, k, v, block_mask=physical, enable_gqa=True)
    run()  # compile now, outside the timing
    return run


# --------------------------------------------------------------------------- decode grid
def _decode_case(device, dtype, backend: str, batch: int, seq_len: int, page: int, shuffled: bool,
                 with_flex: bool, workspace, invalid: set) -> dict:
    """Times (ms) of one B x L x page x order case: every decode schedule, contiguous SDPA, gather + SDPA, flex.

    Each schedule but the default is first checked against the default's output on this data.
    """
    from pagedkv.kernels import DecodeTuning, choose_num_splits, paged_decode_attention
    from pagedkv.kernels.tuning import num_sms

    query, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, shuffled, device, dtype)
    schedules = {}
    default_out = None
    for name, tuning in decode_contenders().items():
        if ("decode", name) in invalid:
            schedules[name] = {"ms": None, "error": "failed validation"}
            continue
        paged = functools.partial(paged_decode_attention, query, k_cache, v_cache, table, lens,
                                  scale=HEAD_DIM ** -0.5, max_seq_len=seq_len, validate=False, backend=backend,
                                  tuning=tuning, workspace=workspace)
        try:
            out = paged().clone()
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            schedules[name] = {"ms": None, "error": describe(error)}
            continue
        if default_out is None:
            default_out = out
        elif max_abs_err(out, default_out) > tolerance_for(dtype):
            schedules[name] = {"ms": None, "error": f"differs from split by {max_abs_err(out, default_out):.1e}"}
            continue
        # Every contender is timed the same way: CUDA-graph replays (no host launch cost in the numbers).
        ms, error = try_time_graphed(paged, device)
        schedules[name] = {"ms": ms, "error": error}
        if name == "split":
            schedules[name]["eager_ms"], _ = try_time(paged, device)
    sdpa_ms, _ = try_time_graphed(contiguous_sdpa(query, k_cache, v_cache, table, seq_len), device)
    gather_ms, _ = try_time_graphed(gather_sdpa(query, k_cache, v_cache, table, seq_len), device)
    flex_ms, flex_note = None, "skipped"
    if with_flex and page == 128 and (batch, seq_len) in ((64, 4096), (1, 32768)):
        try:
            flex_ms, flex_note = try_time(flex_paged(query, k_cache, v_cache, table, seq_len), device)
        except Exception as error:  # noqa: BLE001 - a benchmark reports a failure, it never stops
            flex_note = describe(error)
    return {"schedules": schedules, "sdpa_ms": sdpa_ms, "gather_ms": gather_ms, "flex_ms": flex_ms,
            "flex_note": "" if flex_ms else flex_note,
            "num_splits": choose_num_splits(batch, NUM_KV_HEADS, seq_len, num_sms(device), DecodeTuning())}


def decode_grid(device, dtype, backend: str, grid, copy_tbps: float, with_flex: bool, invalid: set,
                progress) -> list[dict]:
    """Time paged decode over the B x L grid, both page sizes, ordered and shuffled, plus the baselines."""
    import torch

    from pagedkv.kernels import KernelWorkspace

    workspace = KernelWorkspace(max(b for b, _ in grid) * NUM_KV_HEADS, device)
    rows = []
    for batch, seq_len in grid:
        num_bytes = kv_bytes(batch, seq_len, torch.empty((), dtype=dtype).element_size())
        for page in PAGE_SIZES:
            ordered_ms = None
            for shuffled in (False, True):
                case = _decode_case(device, dtype, backend, batch, seq_len, page, shuffled, with_flex, workspace,
                                    invalid)
                default = case["schedules"]["split"]
                ms = default["ms"]
                schedule_tbps = {name: tbps(num_bytes, s["ms"]) for name, s in case["schedules"].items()}
                best = max(schedule_tbps, key=lambda name: schedule_tbps[name] or 0.0)
                row = {
                    "batch": batch, "seq_len": seq_len, "page": page, "order": "shuffled" if shuffled else "ordered",
                    "num_splits": case["num_splits"], "kv_bytes": num_bytes, "ms": ms, "error": default["error"],
                    "tbps": tbps(num_bytes, ms), "copy_fraction": tbps(num_bytes, ms) / copy_tbps if ms else None,
                    "eager_ms": default.get("eager_ms"), "eager_tbps": tbps(num_bytes, default.get("eager_ms")),
                    "sdpa_tbps": tbps(num_bytes, case["sdpa_ms"]),
                    "vs_sdpa": case["sdpa_ms"] / ms if ms and case["sdpa_ms"] else None,
                    "gather_sdpa_tbps": tbps(num_bytes, case["gather_ms"]),
                    "flex_tbps": tbps(num_bytes, case["flex_ms"]), "flex_note": case["flex_note"],
                    "schedules": {name: {"tbps": schedule_tbps[name], "error": s["error"]}
                                  for name, s in case["schedules"].items()},
                    "best_schedule": best, "best_tbps": schedule_tbps[best],
                    "best_vs_sdpa": (case["sdpa_ms"] * schedule_tbps[best] * 1e-3 * 1e12 / num_bytes
                                     if case["sdpa_ms"] and schedule_tbps[best] else None),
                }
                if shuffled:
                    row["shuffled_over_ordered"] = ms / ordered_ms if ms and ordered_ms else None
                else:
                    ordered_ms = ms
                row["targets"] = _targets(row, copy_tbps)
                rows.append(row)
                progress(f"decode B={batch} L={seq_len} page={page} {row['order']}: split {fmt(row['tbps'])} TB/s, "
                         f"best {best} {fmt(row['best_tbps'])} TB/s, SDPA {fmt(row['sdpa_tbps'])}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _targets(row: dict, copy_tbps: float) -> list[str]:
    """The issues' targets that apply to this row, each 'name: met (figure)' or 'name: MISSED (figure)'."""
    results = []

    def check(name, passed, figure):
        results.append(f"{name}: {'met' if passed else 'MISSED'} ({figure})")

    key = (row["batch"], row["seq_len"])
    best = row["best_tbps"] or 0.0
    if key == (64, 4096):
        check(">=90% copy BW", (row["tbps"] or 0) >= 0.9 * copy_tbps, f"{fmt(row['tbps'])} TB/s")
        check(">=0.95x SDPA", (row["vs_sdpa"] or 0) >= 0.95, f"{fmt(row['vs_sdpa'])}x")
    elif key in SMALL_WORK:
        check(">=80% copy BW", best >= 0.8 * copy_tbps, f"{best:.2f} TB/s = {100 * best / copy_tbps:.0f}%, "
                                                         f"{row['best_schedule']}")
    elif key == (256, 512):
        check(">=1.0x SDPA", (row["best_vs_sdpa"] or 0) >= 1.0, f"{fmt(row['best_vs_sdpa'])}x, {row['best_schedule']}")
    if row["order"] == "shuffled" and row.get("shuffled_over_ordered") is not None:
        check("shuffled within 5%", row["shuffled_over_ordered"] <= 1.05, f"{row['shuffled_over_ordered']:.3f}")
    return results


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The decode grid as a printable table: (header, body), one line per row, one column per extra schedule."""
    names = list(rows[0].get("schedules", {})) if rows else []
    header = ["B", "L", "page", "order", "splits", "time us", "TB/s", "% copy", "eager TB/s",
              *[f"{name} TB/s" for name in names[1:]], "SDPA TB/s", "paged/SDPA", "best/SDPA", "gather+SDPA TB/s",
              "flex TB/s", "targets"]
    body = []
    for row in rows:
        schedules = row.get("schedules", {})
        body.append([
            str(row["batch"]), str(row["seq_len"]), str(row["page"]), row["order"], str(row["num_splits"]),
            fmt(row["ms"] and row["ms"] * 1e3, ".1f", row["error"] or "n/a"), fmt(row["tbps"]),
            fmt(row["copy_fraction"] and 100 * row["copy_fraction"], ".0f"), fmt(row.get("eager_tbps")),
            *[fmt(schedules[name]["tbps"], ".2f", (schedules[name]["error"] or "n/a")[:24]) for name in names[1:]],
            fmt(row["sdpa_tbps"]), fmt(row["vs_sdpa"]), fmt(row.get("best_vs_sdpa")),
            fmt(row["gather_sdpa_tbps"]),
            fmt(row["flex_tbps"], ".2f", "n/a" + (f" ({row['flex_note']})" if row["flex_note"] != "skipped" else "")),
            "; ".join(row["targets"]),
        ])
    return header, body
