"""The simulator's jobs: PageFault's stage-4 mix, split into prompt and output, with distinct prompts.

Each job's total length `L` comes from `pagedkv.core.generate_lengths` (50% short 32-128,
30% medium 256-512, 20% long 1024-2048, SplitMix64, identical on every platform). It is
split at a fixed fraction:

    | prompt: max(1, floor(L * prompt_fraction)) | output: the rest, >= 1 (ignore_eos) |
    0                                      num_prompt_tokens                            L

The default `prompt_fraction` is 0.25: three quarters of every sequence is generated, so a
sequence's KV keeps growing after admission, which is what a paging scheduler has to
survive (admission only sees the prompt). Output is generated with `ignore_eos` and
`max_tokens = L - num_prompt_tokens`, so each job ends exactly at its drawn length.

Prompt token ids and priorities come from a second SplitMix64 stream seeded from the
workload seed, so no two jobs share a prefix block (the prefix cache then only hits when a
preempted job is re-admitted and finds its own blocks still cached). Priorities (0-3) give
the "priority" victim policy something to rank by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.workload import DEFAULT_MIX, LengthBucket, SplitMix64, generate_lengths
from pagedkv.errors import InvalidArgumentError, require_positive_int

DEFAULT_NUM_JOBS = 512
DEFAULT_SEED = 42
DEFAULT_PROMPT_FRACTION = 0.25
DEFAULT_VOCAB_SIZE = 32_000
NUM_PRIORITIES = 4

# Keeps the token stream independent of the length stream that uses the seed itself.
_TOKEN_STREAM_SALT = 0x5EED_70CE_1D5


@dataclass(frozen=True)
class Job:
    """One request of the workload: its prompt, how many tokens it generates, its priority."""

    job_id: int
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int
    priority: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output: the KV length the job reaches."""
        return len(self.prompt_token_ids) + self.num_output_tokens


def split_length(num_tokens: int, prompt_fraction: float) -> tuple[int, int]:
    """(prompt, output) tokens of a job of `num_tokens` total; both are at least 1."""
    if num_tokens < 2:
        raise InvalidArgumentError(f"a job needs at least 2 tokens (1 prompt, 1 output), got {num_tokens}")
    num_prompt = min(max(1, int(num_tokens * prompt_fraction)), num_tokens - 1)
    return num_prompt, num_tokens - num_prompt


def random_tokens(rng: SplitMix64, num_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """`num_tokens` token ids in [1, vocab_size) from `rng`."""
    # One 64-bit draw gives four 16-bit-ish token ids: a quarter of the generator calls.
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        x = rng.next_u64()
        for _ in range(4):
            tokens.append(1 + (x & 0xFFFF) % (vocab_size - 1))
            x >>= 16
    return tokens[:num_tokens]


def jobs_from_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int], seed: int = DEFAULT_SEED,
                      vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[Job]:
    """Jobs with these prompt and output lengths, distinct seeded prompt tokens and priorities."""
    if len(prompt_lens) != len(output_lens):
        raise InvalidArgumentError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    require_positive_int("vocab_size", vocab_size)
    if vocab_size < 2:
        raise InvalidArgumentError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = SplitMix64(seed ^ _TOKEN_STREAM_SALT)
    jobs = []
    for job_id, (num_prompt, num_output) in enumerate(zip(prompt_lens, output_lens)):
        require_positive_int(f"prompt length of job {job_id}", num_prompt)
        require_positive_int(f"output length of job {job_id}", num_output)
        tokens = random_tokens(rng, num_prompt, vocab_size)
        jobs.append(Job(job_id, tuple(tokens), num_output, priority=rng.randint(0, NUM_PRIORITIES - 1)))
    return jobs


def make_jobs(num_jobs: int = DEFAULT_NUM_JOBS, seed: int = DEFAULT_SEED,
              prompt_fraction: float = DEFAULT_PROMPT_FRACTION, mix: Sequence[LengthBucket] = DEFAULT_MIX,
              vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[Job]:
    """PageFault's stage-4 workload: `num_jobs` mixed-length jobs, identical for the same seed."""
    require_positive_int("jobs", num_jobs)
    if not 0.0 < prompt_fraction < 1.0:
        raise InvalidArgumentError(f"prompt_fraction must be in (0, 1), got {prompt_fraction}")
    splits = [split_length(n, prompt_fraction) for n in generate_lengths(num_jobs, seed=seed, mix=mix)]
    return jobs_from_lengths([p for p, _ in splits], [o for _, o in splits], seed=seed, vocab_size=vocab_size)
