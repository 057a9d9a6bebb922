"""KV tiers in the calculator: what a host tier and a disk tier hold, and what bringing a prefix back costs.

    tier tokens        = tier bytes / KV bytes per token           (whole blocks)
    restore seconds    = prompt tokens x KV bytes per token / host-to-device bandwidth
    disk read seconds  = prompt tokens x KV bytes per token / disk read bandwidth
    recompute seconds  = prompt tokens x the cost model's prefill seconds per token

With layer groups (sliding-window layers, `pagedkv.core.kv_groups`) a tier block is one group's page, and
a cached token keeps a page in every group, while a restore copies only what a hit takes: every full
group's blocks of the prompt and each sliding group's window at its end:

    tier tokens        = tier bytes / (groups x page) x B
    restore bytes      = sum over groups of hit blocks x page   (full: T / B; sliding: the window's)

The bandwidths come from the packaged cost model's `kv_tiers` object (`pagedkv/sim/data/`),
which says whether they were measured; its prefill time per token is that of the model it was
calibrated on, so the recompute column is for that model, and is labelled so.
"""

from __future__ import annotations

from typing import Any

from pagedkv.calc.capacity import Formula, format_bytes

#: Prompt lengths the restore-vs-recompute table prints.
PROMPT_TOKENS = (1_000, 8_000, 32_000)


def restore_bytes(tokens: int, bytes_per_token: int, block_size: int, layout=None) -> int:
    """KV bytes a hit on a `tokens`-token prefix copies back (with a `KVLayout`: per group, windows only)."""
    if layout is None:
        return tokens * bytes_per_token
    num_hit = tokens // block_size
    return layout.page_size_bytes(block_size) * sum(
        num_hit - group.first_live_block(num_hit * block_size, block_size) for group in layout.groups)


def tiers_section(bytes_per_token: int, block_size: int, host_bytes: int, disk_bytes: int,
                  layout=None) -> dict[str, Any]:
    """The tiers' capacity and per-prompt costs, JSON-ready (`host_bytes` / `disk_bytes` may be 0); `layout`: the
    model's layer groups, for a model with sliding-window layers."""
    from pagedkv.sim.cost_model import packaged_cost_model

    cost = packaged_cost_model()
    # The tier bytes one block of tokens keeps: with layer groups, a page in every group.
    block_bytes = bytes_per_token * block_size if layout is None else \
        layout.page_size_bytes(block_size) * layout.num_groups
    rows = []
    for tokens in PROMPT_TOKENS:
        kv = restore_bytes(tokens, bytes_per_token, block_size, layout)
        rows.append({"prompt_tokens": tokens, "kv_bytes": kv, "restore_s": kv / cost.h2d_bytes_per_s,
                     "spill_s": kv / cost.d2h_bytes_per_s, "disk_read_s": kv / cost.disk_read_bytes_per_s,
                     "recompute_s": tokens * cost.prefill_s_per_token})
    return {
        "host_bytes": host_bytes, "host_blocks": host_bytes // block_bytes,
        "host_tokens": host_bytes // block_bytes * block_size,
        "disk_bytes": disk_bytes, "disk_blocks": disk_bytes // block_bytes,
        "disk_tokens": disk_bytes // block_bytes * block_size,
        "h2d_bytes_per_s": cost.h2d_bytes_per_s, "d2h_bytes_per_s": cost.d2h_bytes_per_s,
        "disk_read_bytes_per_s": cost.disk_read_bytes_per_s, "bandwidths_measured": cost.tiers_measured,
        "recompute_model": cost.source, "prefill_s_per_token": cost.prefill_s_per_token, "prompts": rows,
        "layer_groups": layout is not None,
    }


def tiers_formulas(section: dict[str, Any], bytes_per_token: int, block_size: int) -> list[Formula]:
    """The formulas of the section, with its numbers."""
    gbps = section["h2d_bytes_per_s"] / 1e9
    first = section["prompts"][0]
    if section["layer_groups"]:
        per_block, moved = "a page in every group", "hit blocks of every group (sliding: the window) x page"
    else:
        per_block, moved = f"{bytes_per_token:,} B x {block_size}", f"tokens x {bytes_per_token:,} B"
    return [
        Formula("host tier tokens", f"host bytes // ({per_block}) x {block_size}", f"{section['host_tokens']:,}"),
        Formula("restore time", f"{moved} / {gbps:g} GB/s host-to-device",
                f"{first['restore_s'] * 1e3:.2f} ms for {first['prompt_tokens']:,} tokens"),
    ]


def print_tiers(console, section: dict[str, Any], table) -> None:
    """The tiers' capacity and the restore-vs-recompute table (`table` makes a titled rich table)."""
    measured = "measured" if section["bandwidths_measured"] else "placeholders, not measured"
    capacity = table(f"KV tiers (bandwidths: {measured})", "", "value")
    capacity.add_row("host tier", f"{format_bytes(section['host_bytes'])} = {section['host_tokens']:,} tokens")
    if section["disk_bytes"]:
        capacity.add_row("disk tier", f"{format_bytes(section['disk_bytes'])} = {section['disk_tokens']:,} tokens")
    capacity.add_row("host -> device / device -> host", f"{section['h2d_bytes_per_s'] / 1e9:g} / "
                     f"{section['d2h_bytes_per_s'] / 1e9:g} GB/s pinned")
    capacity.add_row("disk read", f"{section['disk_read_bytes_per_s'] / 1e9:g} GB/s")
    console.print(capacity)
    costs = table("Bringing a prompt's prefix back, against computing it", "prompt tokens", "KV", "from host",
                  "from disk", "recompute*")
    for row in section["prompts"]:
        costs.add_row(f"{row['prompt_tokens']:,}", format_bytes(row["kv_bytes"]), f"{row['restore_s'] * 1e3:.1f} ms",
                      f"{(row['disk_read_s'] + row['restore_s']) * 1e3:.1f} ms", f"{row['recompute_s'] * 1e3:.1f} ms")
    console.print(costs)
    console.print(f"* recompute at the cost model's prefill rate, measured on {section['recompute_model']}",
                  markup=False, highlight=False)
