"""A hypothesis state machine: allocator + block tables against a plain model, thousands of steps."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import BlockAllocator, BlockTable, OutOfBlocksError, SequenceTooLongError

NUM_BLOCKS = 24
BLOCK_SIZE = 4
MAX_TOKENS = 40


class PagingMachine(RuleBasedStateMachine):
    """The model: each live table's token count; blocks = ceil(tokens / B), shared via fork."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(NUM_BLOCKS)
        self.tables: list[BlockTable] = []
        self.model_tokens: list[int] = []

    def model_free_after(self, extra_blocks: int) -> int:
        return self.allocator.num_free - extra_blocks

    @rule(length=st.integers(0, MAX_TOKENS))
    def new_sequence(self, length):
        table = BlockTable(self.allocator, BLOCK_SIZE, max_num_tokens=MAX_TOKENS)
        needed = -(-length // BLOCK_SIZE)
        free_before = self.allocator.num_free
        if needed > free_before:
            try:
                table.append_tokens(length)
                raise AssertionError("expected OutOfBlocksError")
            except OutOfBlocksError:
                assert self.allocator.num_free == free_before
            return
        table.append_tokens(length)
        assert self.allocator.num_free == free_before - needed
        self.tables.append(table)
        self.model_tokens.append(length)

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), extra=st.integers(0, 12))
    def grow(self, index, extra):
        i = index % len(self.tables)
        table = self.tables[i]
        needed = table.num_blocks_needed(extra)
        free_before, blocks_before = self.allocator.num_free, list(table.block_ids)
        try:
            copies = table.append_tokens(extra)
        except (OutOfBlocksError, SequenceTooLongError):
            assert self.model_tokens[i] + extra > MAX_TOKENS or needed > free_before
            assert table.block_ids == blocks_before and self.allocator.num_free == free_before
            return
        self.model_tokens[i] += extra
        assert len(copies) <= 1
        for copy in copies:
            assert copy.src in blocks_before and copy.dst in table.block_ids

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def fork(self, index):
        i = index % len(self.tables)
        self.tables.append(self.tables[i].fork())
        self.model_tokens.append(self.model_tokens[i])

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        i = index % len(self.tables)
        self.tables.pop(i).free()
        self.model_tokens.pop(i)

    @invariant()
    def consistent(self):
        self.allocator.check_integrity()
        owners: dict[int, int] = {}
        for table, tokens in zip(self.tables, self.model_tokens):
            assert table.num_tokens == tokens
            assert table.num_blocks == -(-tokens // BLOCK_SIZE)
            for block_id in table.block_ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id in range(NUM_BLOCKS):
            assert self.allocator.ref_count(block_id) == owners.get(block_id, 0)
        # Writable slots never collide: every table's partial last block is private or unwritten.
        assert self.allocator.num_used == len(owners)

    def teardown(self):
        for table in self.tables:
            table.free()
        assert self.allocator.num_used == 0
        self.allocator.check_integrity()


PagingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestPaging = PagingMachine.TestCase
