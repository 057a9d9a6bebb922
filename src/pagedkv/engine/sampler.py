"""TEMPORARY stand-in for the batched sampler (being rewritten on the `sampler` branch)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    seed: int
    sample_indices: tuple[int, ...]
    num_output_tokens: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


class SamplerOutput:
    def __init__(self, tokens: list[list[int]]):
        self._tokens = tokens

    def token_ids(self) -> list[list[int]]:
        return self._tokens


class Sampler:
    def __init__(self, vocab_size: int, device, eos_token_ids: Iterable[int] = ()):
        self.device = device

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        out = []
        for i, row in enumerate(rows):
            if row.params.temperature < 1e-5:
                out.append([int(logits[i].argmax())] * len(row.sample_indices))
            else:
                toks = []
                for k in row.sample_indices:
                    g = torch.Generator(device=logits.device).manual_seed((row.seed * 1000003 + k * 7919 + row.num_output_tokens) % 2**62)
                    probs = (logits[i] / row.params.temperature).softmax(-1)
                    toks.append(int(torch.multinomial(probs, 1, generator=g)))
                out.append(toks)
        return SamplerOutput(out)
