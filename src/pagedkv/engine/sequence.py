"""Request state: one `Sequence` per generated continuation. State only, no behaviour.

A sequence's tokens are its prompt followed by its outputs. `num_computed_tokens` counts the
leading tokens whose K/V is in the cache; the scheduler advances it, and preemption by
recompute sets it back to 0:

    | prompt ................................ | outputs ........ |
    | computed (K/V cached)        | to compute next steps       |
    0                    num_computed_tokens             num_tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedkv.engine.sampling_params import SamplingParams

#: A token sampled on the device whose value the host does not know yet (async scheduling).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    """Where a sequence is: a queue of the scheduler, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence finished (the OpenAI `finish_reason` vocabulary, plus rejection and error)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    REJECTED = "rejected"  # could never fit; refused at admission
    ERROR = "error"  # failed inside the engine (its step-mates went on)


@dataclass(eq=False)
class Sequence:
    """One continuation of a request."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    priority: int = 0
    sample_index: int = 0  # which of the request's n samples
    group_id: int = -1  # seq id of the request's first sequence (set to seq_id when not given)
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs, appended in place
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    seed: int = 0  # the request's 64-bit sampling-stream seed (its own, or one the engine drew for it)
    num_pending: int = 0  # trailing PENDING_TOKENs: sampled by steps whose results have not come back
    # Prefix-cache keys of its leading full blocks (`prefix_cache.block_keys`): sent by the router that
    # hashed the prompt, or computed at the first admission attempt, then reused rather than re-hashed.
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.group_id < 0:
            self.group_id = self.seq_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def first_pending_index(self) -> int:
        """Index of the first token whose value is not known yet (num_tokens when all are known)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def known_output_token_ids(self) -> list[int]:
        """The outputs whose values are known (pending tokens excluded)."""
        return self.token_ids[len(self.prompt_token_ids):len(self.token_ids) - self.num_pending]

    @property
    def is_done(self) -> bool:
        """Finished, and its last token has come back from the device."""
        return self.status is SequenceStatus.FINISHED and self.num_pending == 0

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
