"""Layer groups in the calculator: what a sequence costs when sliding-window layers keep only their window.

For a model with sliding-window layers, one sequence of L tokens costs (B = block size):

    naive, full length        L * bytes/token                       every layer, reserved up front
    paged, every layer full   ceil(L / B) * B * bytes/token         paging, but no layer drops a token
    paged per group           sum over groups of blocks(L) * page   what pagedkv's engine holds

where a full group holds ceil(L / B) blocks, a sliding group of window W at most
ceil((W - 1) / B) + 1 (in decode; a prefill chunk of C tokens briefly needs
ceil((W + C - 2) / B) + 1), and every block (page) holds `num_slots` layers of one group
(`pagedkv.core.kv_groups`: padding slots are counted). A budget then holds
floor(budget / per-sequence bytes) sequences of L tokens under each scheme.
"""

from __future__ import annotations

from typing import Any

from pagedkv.calc.capacity import Formula, format_bytes
from pagedkv.calc.sizing import KVSizing
from pagedkv.core import num_blocks_for
from pagedkv.errors import require_positive_int


def groups_section(sizing: KVSizing, num_tokens: int, block_size: int,
                   budget_bytes: int | None = None) -> dict[str, Any]:
    """Per-group sizing and the three per-sequence costs at `num_tokens` (with concurrency under a budget)."""
    require_positive_int("num_tokens", num_tokens)
    require_positive_int("block_size", block_size)
    layout = sizing.kv_layout()
    page = layout.page_size_bytes(block_size)
    groups = []
    for group in layout.groups:
        num_blocks = group.max_blocks_per_seq(num_tokens, block_size)
        groups.append({"type": group.attention_type, "sliding_window": group.sliding_window,
                       "num_layers": len(group.layer_indices), "num_slots": group.num_slots,
                       "bytes_per_token": len(group.layer_indices) * group.bytes_per_token_per_layer,
                       "page_size_bytes": page, "num_blocks_per_seq": num_blocks, "bytes_per_seq": num_blocks * page})
    schemes = {"naive_full_length": num_tokens * sizing.bytes_per_token,
               "paged_full_length": layout.full_length_seq_kv_bytes(num_tokens, block_size),
               "paged_per_group": layout.seq_kv_bytes(num_tokens, block_size)}
    section: dict[str, Any] = {
        "num_tokens": num_tokens, "block_size": block_size, "num_groups": layout.num_groups,
        "num_slots": layout.num_slots, "page_size_bytes": page, "groups": groups,
        "bytes_per_seq": schemes,
        "gain_over_paged_full_length": schemes["paged_full_length"] / schemes["paged_per_group"],
        "budget_bytes": budget_bytes, "num_seqs": None}
    if budget_bytes is not None:
        section["num_seqs"] = {name: budget_bytes // cost for name, cost in schemes.items()}
    return section


def groups_formulas(section: dict[str, Any]) -> list[Formula]:
    """The per-sequence costs with this run's numbers."""
    length, block_size = section["num_tokens"], section["block_size"]
    terms = " + ".join(f"{g['num_blocks_per_seq']:,}" for g in section["groups"])
    costs = section["bytes_per_seq"]
    return [
        Formula("grouped per seq", "sum over groups of blocks(L) * page, blocks = ceil(L / B) full, "
                "min(ceil(L / B), ceil((W - 1) / B) + 1) sliding",
                f"({terms}) * {format_bytes(section['page_size_bytes'])} = {format_bytes(costs['paged_per_group'])}"),
        Formula("full-length per seq", "ceil(L / B) * B * bytes/token",
                f"{num_blocks_for(length, block_size):,} * {block_size} * bytes/token = "
                f"{format_bytes(costs['paged_full_length'])}"),
    ]


def render_groups(console, section: dict[str, Any], table_factory) -> None:
    """Print the group table and the three schemes side by side."""
    length = section["num_tokens"]
    table = table_factory(f"Layer groups ({section['num_groups']} groups of {section['num_slots']} layer slots, one "
                          f"pool of {format_bytes(section['page_size_bytes'])} blocks)", "group", "layers",
                          "KV per token", f"blocks per {length:,}-token seq", "KV per seq")
    for group in section["groups"]:
        kind = "full" if group["sliding_window"] is None else f"sliding {group['sliding_window']:,}"
        padding = group["num_slots"] - group["num_layers"]
        table.add_row(kind, f"{group['num_layers']}" + (f" (+{padding} padding)" if padding else ""),
                      f"{group['bytes_per_token']:,} B", f"{group['num_blocks_per_seq']:,}",
                      format_bytes(group["bytes_per_seq"]))
    console.print(table)
    names = {"naive_full_length": "naive, full length", "paged_full_length": "paged, every layer full length",
             "paged_per_group": "paged per layer group (pagedkv)"}
    columns = ["scheme", f"KV per {length:,}-token seq", "vs per group"]
    if section["num_seqs"] is not None:
        columns.append(f"sequences in {format_bytes(section['budget_bytes'])}")
    schemes = table_factory(f"One {length:,}-token sequence", *columns)
    grouped = section["bytes_per_seq"]["paged_per_group"]
    for key, name in names.items():
        cost = section["bytes_per_seq"][key]
        row = [name, format_bytes(cost), f"{cost / grouped:.2f}x"]
        if section["num_seqs"] is not None:
            row.append(f"{section['num_seqs'][key]:,}")
        schemes.add_row(*row)
    console.print(schemes)
