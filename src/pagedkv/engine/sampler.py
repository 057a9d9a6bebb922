"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax together. Random rows draw with the exponential-race trick
(`argmax(p / Exp(1))` samples from `p`) using the request's own generator when it has a
seed, so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from pagedkv.engine.sampling import SamplingParams


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to one row of logits ([vocab], float32)."""
    logits = logits / params.temperature
    if params.top_k_enabled and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    """Samples one or more tokens per row of logits."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[tuple[int, int], torch.Generator] = {}

    def generator_for(self, key: tuple[int, int], seed: int) -> torch.Generator:
        """The private generator of one seeded sequence (created on first use)."""
        generator = self._seeded.get(key)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._seeded[key] = generator
        return generator

    def release(self, key: tuple[int, int]) -> None:
        """Forget a finished sequence's generator."""
        self._seeded.pop(key, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], keys: list[tuple[int, int]],
               counts: list[int]) -> list[list[int]]:
        """`counts[i]` tokens for row i of `logits` ([rows, vocab]); `keys[i]` identifies row i's sequence."""
        logits = logits.float()
        results: list[list[int]] = [[] for _ in params]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            tokens = logits.index_select(0, index).argmax(-1).tolist()
            for row, token in zip(greedy_rows, tokens):
                results[row] = [token] * counts[row]
        for row, p in enumerate(params):
            if p.is_greedy:
                continue
            probs = _filter(logits[row], p).softmax(-1)
            for sample in range(counts[row]):
                key = (keys[row][0], keys[row][1] + sample)
                generator = self.generator if p.seed is None else self.generator_for(key, p.seed + key[1])
                race = torch.empty_like(probs).exponential_(generator=generator)
                results[row].append(int((probs / race).argmax()))
        return results
