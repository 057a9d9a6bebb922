"""Multi-turn chat over shared system prompts, and what KV tiers do for its time to first token.

M conversations, each opened with one of K system prompts, run `num_turns` turns each. A turn's
prompt is the whole conversation so far plus a new user message, so every turn after the first
starts with a prefix the engine has already computed:

    turn 1  | system prompt k | user 1 |
    turn 2  | system prompt k | user 1 | answer 1 | user 2 |
    turn 3  | system prompt k | user 1 | answer 1 | user 2 | answer 2 | user 3 |

`num_concurrent` conversations are live at once (closed loop: a conversation sends its next
turn when the last one is answered, and the next conversation opens when one ends). With a GPU
pool that holds a fraction of the live prefixes, a conversation's history is evicted between
its turns: without KV tiers it is computed again; with them it comes back from host memory.

`simulate_chat` drives the engine's own scheduler on the simulated clock of `simulator.py`
(the cost model prices the KV tiers' copies); `bench/engine_chat_tiers.py` drives the real
engine with the same conversations. Everything comes from SplitMix64 streams of the seed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.core.workload import SplitMix64
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError, require_positive_int
from pagedkv.sim.cluster import percentile
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.simulator import fake_step, job_sequence
from pagedkv.sim.workload import DEFAULT_SEED, DEFAULT_VOCAB_SIZE, Job, random_tokens

_SYSTEM_SALT = 0x5_75E3
_TURN_SALT = 0x7_0A2B
_ANSWER_SALT = 0x3_A45E


@dataclass(frozen=True)
class MultiTurnChat:
    """K system prompts, M conversations of `num_turns` turns, `num_concurrent` of them live at once."""

    num_system_prompts: int = 8
    num_conversations: int = 64
    num_turns: int = 4
    num_concurrent: int = 32
    system_prompt_tokens: int = 1024
    min_user_tokens: int = 32
    max_user_tokens: int = 128
    min_output_tokens: int = 32
    max_output_tokens: int = 96
    seed: int = DEFAULT_SEED
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self):
        for name in ("num_system_prompts", "num_conversations", "num_turns", "num_concurrent", "min_user_tokens",
                     "min_output_tokens", "system_prompt_tokens", "vocab_size"):
            require_positive_int(name, getattr(self, name))
        for low, high in (("min_user_tokens", "max_user_tokens"), ("min_output_tokens", "max_output_tokens")):
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(f"{high} ({getattr(self, high)}) must be >= {low} ({getattr(self, low)})")

    @property
    def max_conversation_tokens(self) -> int:
        """The longest last turn: system prompt, every user message and every answer."""
        return self.system_prompt_tokens + self.num_turns * (self.max_user_tokens + self.max_output_tokens)

    def system_prompt(self, index: int) -> list[int]:
        """System prompt `index`'s tokens."""
        rng = SplitMix64(self.seed ^ _SYSTEM_SALT ^ (index * 0x9E3779B97F4A7C15))
        return random_tokens(rng, self.system_prompt_tokens, self.vocab_size)

    def turn(self, conversation: int, turn: int) -> tuple[int, list[int], int]:
        """(system prompt index, user message tokens, answer length) of one turn."""
        rng = SplitMix64(self.seed ^ _TURN_SALT ^ (conversation * 0x9E3779B97F4A7C15) ^ (turn * 0xBF58476D1CE4E5B9))
        system = conversation % self.num_system_prompts
        user = random_tokens(rng, rng.randint(self.min_user_tokens, self.max_user_tokens), self.vocab_size)
        return system, user, rng.randint(self.min_output_tokens, self.max_output_tokens)

    def answer(self, conversation: int, turn: int, num_tokens: int) -> list[int]:
        """A fixed answer to one turn: `num_tokens` tokens drawn from the seed, never a model's output."""
        rng = SplitMix64(self.seed ^ _ANSWER_SALT ^ (conversation * 0x9E3779B97F4A7C15) ^ (turn * 0xBF58476D1CE4E5B9))
        return random_tokens(rng, num_tokens, self.vocab_size)

    def fixed_turns(self) -> list[tuple[int, int, list[int], int]]:
        """Every turn as (conversation, turn, prompt, answer length), turn by turn across the conversations
        (every conversation's first turn, then every second turn, ...), each history holding the fixed answers
        of `answer`: the same prompts in the same order whatever an engine generates (the engine benchmark)."""
        systems = [self.system_prompt(k) for k in range(self.num_system_prompts)]
        histories: dict[int, list[int]] = {}
        turns = []
        for turn in range(self.num_turns):
            for conversation in range(self.num_conversations):
                system, user, answer_len = self.turn(conversation, turn)
                history = histories.setdefault(conversation, list(systems[system]))
                history.extend(user)
                turns.append((conversation, turn, list(history), answer_len))
                history.extend(self.answer(conversation, turn, answer_len))
        return turns


class Conversations:
    """Which turns are due: conversation histories and the closed loop over them (shared with the bench)."""

    def __init__(self, workload: MultiTurnChat):
        self.workload = workload
        self._systems = [workload.system_prompt(k) for k in range(workload.num_system_prompts)]
        self._history: dict[int, list[int]] = {}
        self._turn: dict[int, int] = {}
        self._next_conversation = 0
        self.num_live = 0

    def start(self) -> list[tuple[int, list[int], int]]:
        """The first turns of the first `num_concurrent` conversations: (conversation, prompt, answer length)."""
        return [self._open() for _ in range(min(self.workload.num_concurrent, self.workload.num_conversations))]

    def _open(self) -> tuple[int, list[int], int]:
        conversation = self._next_conversation
        self._next_conversation += 1
        self.num_live += 1
        system, _, _ = self.workload.turn(conversation, 0)
        self._history[conversation] = list(self._systems[system])
        self._turn[conversation] = 0
        return self._prompt(conversation)

    def _prompt(self, conversation: int) -> tuple[int, list[int], int]:
        _, user, answer_len = self.workload.turn(conversation, self._turn[conversation])
        history = self._history[conversation]
        history.extend(user)
        return conversation, list(history), answer_len

    def answered(self, conversation: int, answer: list[int]) -> tuple[int, list[int], int] | None:
        """A turn's answer came back: the conversation's next turn, or the next conversation's first, or None."""
        self._history[conversation].extend(answer)
        self._turn[conversation] += 1
        if self._turn[conversation] < self.workload.num_turns:
            return self._prompt(conversation)
        del self._history[conversation]
        self.num_live -= 1
        if self._next_conversation < self.workload.num_conversations:
            return self._open()
        return None


def tier_blocks(memory_bytes: int, cost: CostModel, block_size: int) -> int:
    """Blocks of `block_size` tokens that `memory_bytes` hold, at the cost model's KV bytes per token."""
    return int(memory_bytes // (cost.kv_bytes_per_token * block_size))


def simulate_chat(workload: MultiTurnChat, config: SchedulerConfig, cost: CostModel) -> dict:
    """Run every conversation through the engine's scheduler on the simulated clock: TTFT, throughput, tier hits."""
    scheduler = Scheduler(config)
    bm = scheduler.block_manager
    block_size = config.block_size
    conversations = Conversations(workload)
    pending: deque = deque(conversations.start())
    submitted: dict[int, tuple[int, float]] = {}  # seq id -> (conversation, submit time)
    ttft: list[float] = []
    clock = 0.0
    seq_ids = 0
    num_output_tokens = num_prefill_tokens = num_restored = num_offloaded = 0
    while pending or scheduler.has_unfinished():
        while pending:
            conversation, prompt, answer_len = pending.popleft()
            scheduler.add(job_sequence(Job(seq_ids, tuple(prompt), answer_len), seq_ids))
            submitted[seq_ids] = (conversation, clock)
            seq_ids += 1
        out = scheduler.schedule()
        copies = out.tier_copies
        if bm.tiers is not None and copies.disk_loads:
            bm.tiers.finish_loads([(key, True) for key, _ in copies.disk_loads])  # simulated disk: every file reads
        shape, sampled = fake_step(out, block_size, workload.vocab_size)
        dt = cost.step_time_s(shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens,
                              shape.swapped_blocks * block_size)
        dt += cost.tier_copy_s(dt, shape.offloaded_blocks * block_size, shape.restored_blocks * block_size,
                               len(copies.disk_loads) * block_size, shape.pre_spilled_blocks * block_size,
                               shape.restored_in_step_blocks * block_size)
        clock += dt
        num_prefill_tokens += shape.prefill_tokens
        num_restored += shape.restored_blocks + shape.restored_in_step_blocks
        num_offloaded += shape.offloaded_blocks + shape.pre_spilled_blocks
        for item in out.scheduled:
            if item.samples and item.seq.num_output_tokens == 0:
                ttft.append(clock - submitted[item.seq.seq_id][1])
        for seq in scheduler.update(out, sampled):
            num_output_tokens += seq.num_output_tokens
            conversation, _ = submitted.pop(seq.seq_id)
            follow_up = conversations.answered(conversation, seq.output_token_ids)
            if follow_up is not None:
                pending.append(follow_up)
    stats = bm.tiers.stats if bm.tiers is not None else None
    return {
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft), "sim_time_s": clock,
        "output_tokens_per_s": num_output_tokens / clock if clock else 0.0,
        "num_requests": len(ttft), "prefill_tokens": num_prefill_tokens,
        "prefix_hit_tokens": bm.num_prefix_hit_tokens,
        "host_hit_blocks": stats.host_hit_blocks if stats else 0, "restored_blocks": num_restored,
        "offloaded_blocks": num_offloaded,
    }
