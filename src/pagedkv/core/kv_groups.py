"""KV layer groups: which layers share a block table, and what one block of each group costs.

Layers that attend the same way keep the same tokens, so they can share one block table per
sequence. A model's layers fall into attention types, one per distinct (type, window):

    full_attention          every token of the sequence
    sliding_attention, W    the last W tokens: key j is visible to query i iff i - W < j <= i

All groups draw their blocks from ONE pool (one free list). That works because every
group's block has the same size in bytes: a block holds `num_slots` layers' K and V for
`block_size` tokens, and a type with more layers than that is split into several groups of
`num_slots` layers (vLLM's hybrid allocator does the same). Gemma 3 12B (8 full, 40 sliding
layers) becomes one full group and five sliding groups of 8 layers each. Where a type's
layer count is not a multiple of `num_slots`, its last group has unused slots (padding,
counted in every byte figure here). One pool beats pools sized in proportion: the share a
sliding group needs depends on the sequence lengths (as much as a full group below the
window, a sliver above it), and a fixed split would be wrong for one of the two.

A layer's attention reads its group's table (`layer_group`) and its K/V live in the pool's
slot `layer_slot` of each block. A model without sliding layers is one full group whose
blocks hold every layer: exactly the single-table layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.block_table import num_blocks_for
from pagedkv.errors import ConfigError, require_positive_int

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class KVGroupSpec:
    """One group of layers with one block table per sequence: full attention, or a sliding window."""

    layer_indices: tuple[int, ...]
    num_slots: int  # layers one block holds (>= len(layer_indices); the rest is padding)
    bytes_per_token_per_layer: int  # 2 * num_kv_heads * head_dim * dtype_bytes
    sliding_window: int | None = None

    def __post_init__(self):
        require_positive_int("num_slots", self.num_slots)
        require_positive_int("bytes_per_token_per_layer", self.bytes_per_token_per_layer)
        if not 1 <= len(self.layer_indices) <= self.num_slots:
            raise ConfigError(f"a group holds 1..{self.num_slots} layers, got {len(self.layer_indices)}")
        if self.sliding_window is not None:
            require_positive_int("sliding_window", self.sliding_window)

    @property
    def is_sliding(self) -> bool:
        """Whether the group's layers see only the last `sliding_window` keys."""
        return self.sliding_window is not None

    @property
    def attention_type(self) -> str:
        """"full_attention" or "sliding_attention" (HF's layer_types names)."""
        return SLIDING_ATTENTION if self.is_sliding else FULL_ATTENTION

    @property
    def bytes_per_token(self) -> int:
        """One token of one block of this group, padding slots included: num_slots * bytes/token/layer."""
        return self.num_slots * self.bytes_per_token_per_layer

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block (the same in every group of a layout)."""
        return block_size * self.bytes_per_token

    def first_live_block(self, first_query_position: int, block_size: int) -> int:
        """The first block a query at `first_query_position` (or later) can read; 0 for full attention.

        A sliding window W shows keys j > i - W, so blocks wholly before i - W + 1 are never
        read again once every query left to run is at i or later.
        """
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // block_size

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, max_query_tokens: int = 1) -> int:
        """The most blocks a sequence of up to `num_tokens` holds at once, with steps of up to
        `max_query_tokens` query tokens (1: decode).

        A step of C query tokens at [s, s + C) reads keys from s - W + 1: a span of W + C - 1
        tokens, which touches at most ceil((W + C - 2) / B) + 1 blocks; a decode step touches
        at most ceil((W - 1) / B) + 1 <= ceil(W / B) + 1.
        """
        require_positive_int("max_query_tokens", max_query_tokens)
        full = num_blocks_for(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, num_blocks_for(self.sliding_window + max_query_tokens - 2, block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    """A model's layer groups over one pool: who reads which table and which block slot."""

    groups: tuple[KVGroupSpec, ...]
    num_layers: int

    def __post_init__(self):
        require_positive_int("num_layers", self.num_layers)
        if not self.groups:
            raise ConfigError("a KV layout needs at least one group")
        slots = {group.num_slots for group in self.groups}
        if len(slots) != 1:
            raise ConfigError(f"every group's block must hold the same number of layers, got {sorted(slots)}")
        layers = sorted(i for group in self.groups for i in group.layer_indices)
        if layers != list(range(self.num_layers)):
            raise ConfigError(f"the groups must cover layers 0..{self.num_layers - 1} once each, got {layers}")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers one block holds (the pool's second dimension)."""
        return self.groups[0].num_slots

    @property
    def is_hybrid(self) -> bool:
        """Whether any group slides (a model without sliding layers keeps the one-table path)."""
        return any(group.is_sliding for group in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Group index of every layer."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layer_indices:
                out[layer] = g
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Slot of every layer inside its group's blocks."""
        out = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layer_indices):
                out[layer] = slot
        return tuple(out)

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block, in any group."""
        return self.groups[0].page_size_bytes(block_size)

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, max_query_tokens: int = 1) -> int:
        """Blocks of all groups a sequence of up to `num_tokens` holds at once (see `KVGroupSpec`)."""
        return sum(group.max_blocks_per_seq(num_tokens, block_size, max_query_tokens) for group in self.groups)

    def seq_kv_bytes(self, num_tokens: int, block_size: int, max_query_tokens: int = 1) -> int:
        """Pool bytes one sequence of `num_tokens` holds at its peak (padding slots included)."""
        return self.max_blocks_per_seq(num_tokens, block_size, max_query_tokens) * self.page_size_bytes(block_size)

    def full_length_seq_kv_bytes(self, num_tokens: int, block_size: int) -> int:
        """Paged bytes of the same sequence if every layer kept every token (one full-length table)."""
        bytes_per_layer = self.groups[0].bytes_per_token_per_layer
        return num_blocks_for(num_tokens, block_size) * block_size * self.num_layers * bytes_per_layer


def group_layers(layer_types: Sequence[str], sliding_window: int | None, *, bytes_per_token_per_layer: int,
                 num_slots: int | None = None) -> KVLayout:
    """Group layers by (attention type, window), splitting types into groups of `num_slots` layers.

    `num_slots` defaults to the smallest type's layer count (vLLM's choice: the fewest groups
    with no group of the smallest type padded). Without sliding layers the result is one full
    group holding every layer.
    """
    num_layers = len(layer_types)
    require_positive_int("num_layers", num_layers)
    by_type: dict[str, list[int]] = {}
    for layer, kind in enumerate(layer_types):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ConfigError(f"layer {layer} has attention type {kind!r}; known: {FULL_ATTENTION}, "
                              f"{SLIDING_ATTENTION}")
        by_type.setdefault(kind, []).append(layer)
    if SLIDING_ATTENTION in by_type:
        require_positive_int("sliding_window", sliding_window)
    if num_slots is None:
        num_slots = min(len(layers) for layers in by_type.values())
    require_positive_int("num_slots", num_slots)
    groups = []
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        layers = by_type.get(kind, [])
        window = sliding_window if kind == SLIDING_ATTENTION else None
        for start in range(0, len(layers), num_slots):
            groups.append(KVGroupSpec(tuple(layers[start:start + num_slots]), num_slots, bytes_per_token_per_layer,
                                      window))
    return KVLayout(tuple(groups), num_layers)


def single_group_layout(num_layers: int, bytes_per_token_per_layer: int) -> KVLayout:
    """Every layer full attention, in one group: the one-table layout."""
    return group_layers([FULL_ATTENTION] * num_layers, None, bytes_per_token_per_layer=bytes_per_token_per_layer)
