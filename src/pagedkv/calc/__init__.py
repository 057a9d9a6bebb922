"""The KV-cache calculator: what a model's KV cache costs per token, and how many sequences
a memory budget holds when each reserves max_len up front (naive) or whole blocks (paged).

Pure Python (no torch, no transformers), so the engine can log its capacity at startup and
`pagedkv calc` starts instantly. `sizing` reads models (presets, Hugging Face configs);
`capacity` turns a sizing and a budget into sequence counts; `cli` is the command line.
"""

from __future__ import annotations

from pagedkv.calc.capacity import (
    TOY_SPEC,
    BudgetCapacity,
    Formula,
    block_size_sweep,
    budget_capacity,
    budget_formulas,
    sizing_formulas,
)
from pagedkv.calc.sizing import (
    PRESETS,
    KVSizing,
    Preset,
    custom_sizing,
    load_hf_config,
    preset_sizing,
    spec_from_config_file,
    spec_from_hf_config,
)


def main(argv: list[str] | None = None, prog: str = "pagedkv calc") -> int:
    """`pagedkv calc` (the argparse layer loads on first use, with rich)."""
    from pagedkv.calc.cli import main as cli_main

    return cli_main(argv, prog=prog)


__all__ = [
    "PRESETS",
    "TOY_SPEC",
    "BudgetCapacity",
    "Formula",
    "KVSizing",
    "Preset",
    "block_size_sweep",
    "budget_capacity",
    "budget_formulas",
    "custom_sizing",
    "load_hf_config",
    "main",
    "preset_sizing",
    "sizing_formulas",
    "spec_from_config_file",
    "spec_from_hf_config",
]
