"""The batched sampler: stream independence, batch invariance, filters, penalties, logprobs; SamplingParams ranges.

Statistical checks draw thousands of rows with fixed seeds; the bounds are several standard
deviations wide, and each test also shows its bound would catch the wrong distribution.
"""

import collections
import math

import pytest
import torch

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sampler import Sampler, SamplingRow, stream_keys, uniforms
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import InvalidArgumentError, SamplingParamsError

EOS = 3
RANDOM = SamplingParams(temperature=1.0)


def _tokens(logits, rows, eos=(EOS,)):
    return Sampler(logits.shape[-1], "cpu", eos).sample(logits, rows).token_ids()


def _frequencies(logits_row, params, num_draws=20_000):
    """Empirical distribution of one row's first token over `num_draws` seeds."""
    rows = [SamplingRow(params, seed, (0,), 0) for seed in range(num_draws)]
    tokens = _tokens(logits_row.expand(num_draws, -1), rows)
    counts = collections.Counter(t[0] for t in tokens)
    return torch.tensor([counts[v] / num_draws for v in range(logits_row.shape[-1])])


# ---------------------------------------------------------------- streams
def test_consecutive_seeds_and_sample_indices_give_distinct_streams():
    # Before: sample i of seed s used seed s + i, so 120 seeds x 25 samples gave 144 streams.
    vocab, num_tokens = 1000, 4
    streams = [(seed, index) for seed in range(120) for index in range(25)]
    sequences = [[] for _ in streams]
    for counter in range(num_tokens):
        rows = [SamplingRow(RANDOM, seed, (index,), counter) for seed, index in streams]
        for seq, token in zip(sequences, _tokens(torch.zeros(len(rows), vocab), rows)):
            seq += token
    # A flat distribution: about 4.5e6 pairs over vocab**4 = 1e12 sequences, so collisions should not happen.
    assert len({tuple(s) for s in sequences}) == len(streams)
    # First tokens: expected distinct values of 3,000 uniform draws from 1,000 is 1000 * (1 - e^-3) ~ 950 (sd ~ 5).
    expected = vocab * (1 - (1 - 1 / vocab) ** len(streams))
    assert abs(len({s[0] for s in sequences}) - expected) < 25
    assert sequences[streams.index((1, 1))] != sequences[streams.index((2, 0))]
    assert len(set(stream_keys(*zip(*streams)).tolist())) == len(streams)


def test_seeds_are_taken_modulo_2_64():
    assert stream_keys([-1, 7], [0, 0]).tolist() == stream_keys([2**64 - 1, 7 + 2**64], [0, 0]).tolist()
    assert 0 <= uniforms([2**64 - 1, -2**63], [0, 3], [0, 10**9]).min() < 1


def _mixed_batch(vocab):
    """Rows of every kind, to surround the row under test."""
    return [
        SamplingRow(SamplingParams(temperature=0), 1, (0,), 0),
        SamplingRow(SamplingParams(temperature=0.7, top_k=5, top_p=0.8, logprobs=3), 2, (0, 1, 2), 0),
        SamplingRow(SamplingParams(temperature=1.3, repetition_penalty=1.5, frequency_penalty=0.5,
                                   logit_bias={4: 3.0}, min_tokens=4), 3, (1,), 2, (5, 6), (7, 7)),
        SamplingRow(SamplingParams(temperature=0.5, presence_penalty=-1.0), 4, (2,), 9, (1,), (2, 3)),
    ]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.1, repetition_penalty=1.2, presence_penalty=0.5, min_tokens=9),
])
def test_a_draw_does_not_depend_on_the_batch(params):
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    row_logits = torch.randn(vocab, generator=gen) * 3
    others = _mixed_batch(vocab)
    other_logits = torch.randn(len(others), vocab, generator=gen)
    for counter in range(6):
        row = SamplingRow(params, 123, (1,), counter, (1, 2, 3), (9,) * counter)
        alone = _tokens(row_logits[None], [row])[0]
        for position in range(len(others) + 1):
            rows = others[:position] + [row] + others[position:]
            logits = torch.cat([other_logits[:position], row_logits[None], other_logits[position:]])
            assert _tokens(logits, rows)[position] == alone
        assert _tokens(row_logits[None], [row])[0] == alone  # a pure function: recompute draws the same


def test_first_token_of_n_samples_matches_the_samples_drawn_one_by_one():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    together = _tokens(logits, [SamplingRow(RANDOM, 9, (0, 1, 2, 3, 4), 0)])[0]
    apart = [_tokens(logits, [SamplingRow(RANDOM, 9, (i,), 0)])[0][0] for i in range(5)]
    assert together == apart
    greedy = _tokens(logits, [SamplingRow(SamplingParams(temperature=0), 9, (0, 1, 2), 0)])[0]
    assert greedy == [int(logits.argmax())] * 3


# ---------------------------------------------------------------- distributions
def test_temperature_scales_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (0.5, 2.0):
        observed = _frequencies(logits, SamplingParams(temperature=temperature))
        expected = (logits / temperature).softmax(-1)
        assert (observed - expected).abs().max() < 0.015  # sd of a frequency <= 0.0036 at 20,000 draws
        assert (expected - logits.softmax(-1)).abs().max() > 0.1  # so temperature 1 would fail the bound


def test_greedy_takes_the_first_max_and_tiny_temperatures_are_greedy():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, 1e-3, 0.0, 2.0]])
    for temperature in (0.0, 1e-38, 9e-6):
        params = SamplingParams(temperature=temperature)
        assert params.is_greedy
        assert _tokens(logits, [SamplingRow(params, 0, (0,), 0)] * 2) == [[1], [0]]
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_top_k_never_draws_outside_the_top_k():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, 50, generator=gen)
    rows = [SamplingRow(SamplingParams(temperature=1.5, top_k=5), seed, (0,), 0) for seed in range(2000)]
    tokens = torch.tensor(_tokens(logits, rows))
    top5 = logits.topk(5).indices
    assert (tokens == top5).any(-1).all()
    assert len(set((tokens == top5).nonzero()[:, 1].tolist())) == 5  # every rank of the top 5 is drawn


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    observed = _frequencies(logits, SamplingParams(top_p=0.7), num_draws=10_000)
    assert observed[2:].sum() == 0  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 drop
    assert abs(observed[0] - 0.5 / 0.8) < 0.02
    assert _frequencies(logits, SamplingParams(top_p=0.01), num_draws=500)[0] == 1  # the first token stays
    # top-k first, then top-p on the renormalized top 3: 0.5/0.95 + 0.3/0.95 = 0.84 < 0.9, so token 2 stays.
    observed = _frequencies(logits, SamplingParams(top_k=3, top_p=0.9), num_draws=10_000)
    assert observed[3] == 0 and abs(observed[2] - 0.15 / 0.95) < 0.02


# ---------------------------------------------------------------- penalties
def _reference_adjust(logits, row, eos):
    """One row's logits after penalties, logit_bias and min_tokens, written out plainly."""
    p, out = row.params, logits.clone()
    for token in set(row.prompt_token_ids) | set(row.output_token_ids):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(row.output_token_ids):
        out[token] -= p.frequency_penalty * row.output_token_ids.count(token) + p.presence_penalty
    for token, bias in p.logit_bias or ():
        out[token] += bias
    if row.num_output_tokens < p.min_tokens:
        for token in p.stop_token_ids + (() if p.ignore_eos else eos):
            out[token] = float("-inf")
    return out


def test_penalties_bias_and_min_tokens_change_logits_as_the_formulas_say():
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    rows = [
        SamplingRow(SamplingParams(repetition_penalty=1.7), 1, (0,), 3, (1, 2, 3, 2), (4, 4, 5)),
        SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=-0.3), 1, (0,), 5,
                    (6,), (7, 7, 7, 8, 9)),
        SamplingRow(SamplingParams(repetition_penalty=0.8, frequency_penalty=-2, presence_penalty=2,
                                   logit_bias={0: -100, 7: 2.5}), 1, (0,), 2, (7, 8), (8, 1)),
        SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=(11, 12)), 1, (0,), 1),
        SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=(11,), ignore_eos=True), 1, (0,), 0),
        SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=(11,)), 1, (0,), 2),  # min_tokens reached
        SamplingRow(RANDOM, 1, (0,), 4, (1, 2), (3, 4)),  # no penalty: history is ignored
    ]
    logits = torch.randn(len(rows), vocab, generator=gen) * 4
    adjusted = Sampler(vocab, "cpu", (EOS,)).adjusted_logits(logits, rows)
    expected = torch.stack([_reference_adjust(logits[i], row, (EOS,)) for i, row in enumerate(rows)])
    torch.testing.assert_close(adjusted, expected, rtol=1e-6, atol=1e-5)
    assert not torch.equal(adjusted[:3], logits[:3])
    assert torch.equal(adjusted[-2:], logits[-2:])


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([0.0, 6.0, 0.5, 1.0, -2.0])
    banned = _frequencies(logits, SamplingParams(logit_bias={1: -100}), num_draws=5000)
    assert banned[1] == 0 and banned[[0, 2, 3, 4]].min() > 0
    assert _frequencies(logits, SamplingParams(logit_bias={4: 100}), num_draws=500)[4] == 1
    greedy = SamplingParams(temperature=0, logit_bias=[(1, -100.0)])
    assert _tokens(logits[None], [SamplingRow(greedy, 0, (0,), 0)]) == [[3]]


def test_min_tokens_masks_eos_and_stop_tokens_until_enough_outputs():
    logits = torch.full((8,), -1.0)
    logits[EOS], logits[5] = 20.0, 19.0  # EOS, then stop token 5, dominate
    for params in (SamplingParams(min_tokens=3, stop_token_ids=(5,)),
                   SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(5,))):
        rows = [SamplingRow(params, seed, (0,), counter) for counter in range(5) for seed in range(200)]
        tokens = [t[0] for t in _tokens(logits.expand(len(rows), -1), rows)]
        early, late = tokens[:600], tokens[600:]
        assert EOS not in early and 5 not in early
        assert late.count(EOS) > 250  # once 3 tokens exist, EOS is back (400 * 73% = 292 at temperature 1)
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert _tokens(logits[None], [SamplingRow(ignore, 0, (0,), 0)]) == [[EOS]]  # EOS does not stop it


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_the_models_log_softmax_with_a_sorted_top_list():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, generator=gen).to(torch.bfloat16)
    rows = [
        SamplingRow(SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=2.0), 1, (0, 1), 3, (1,), (2,)),
        SamplingRow(SamplingParams(temperature=0), 2, (0,), 0),
        SamplingRow(SamplingParams(temperature=0, logprobs=0), 3, (0,), 0),
        SamplingRow(SamplingParams(logprobs=20, logit_bias={7: 100}), 4, (0,), 0),
    ]
    out = Sampler(30, "cpu").sample(logits, rows)
    tokens, logprobs = out.token_ids(), out.logprobs()
    reference = logits.float().log_softmax(-1)
    assert [len(lp) for lp in logprobs] == [2, 1, 1, 1] and logprobs[1] == [None]
    for i, (row_tokens, row_logprobs) in enumerate(zip(tokens, logprobs)):
        for token, entry in zip(row_tokens, row_logprobs):
            if entry is None:
                continue
            assert isinstance(entry, TokenLogprobs) and entry.token_id == token
            assert math.isclose(entry.logprob, reference[i, token], abs_tol=1e-6)
            assert len(entry.top) == rows[i].params.logprobs
            assert [t for t, _ in entry.top] == reference[i].topk(len(entry.top)).indices.tolist()
            assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))
    assert tokens[3] == [7] and logprobs[3][0].logprob < -0.5  # the biased draw; logprob of the raw model


# ---------------------------------------------------------------- validation
def test_sampler_rejects_mismatched_logits():
    sampler = Sampler(10, "cpu")
    with pytest.raises(InvalidArgumentError, match=r"\[2 rows, 10 vocab\]"):
        sampler.sample(torch.zeros(2, 11), [SamplingRow(RANDOM, 0, (0,), 0)] * 2)
    with pytest.raises(InvalidArgumentError, match="sample index"):
        sampler.sample(torch.zeros(1, 10), [SamplingRow(RANDOM, 0, (), 0)])
    assert sampler.sample(torch.zeros(0, 10), []).token_ids() == []


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [(1, 2, 3)]),
    ("logit_bias", [(1, 1.0), (1, 2.0)]), ("logit_bias", 7),
    ("min_tokens", -1), ("min_tokens", 17), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
])
def test_invalid_new_sampling_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_sampling_params_limits_and_derived_flags():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-2**63).seed == -2**63
    with pytest.raises(SamplingParamsError, match=r"\[-2\*\*63, 2\*\*64 - 1\]"):
        SamplingParams(seed=2**64)
    params = SamplingParams(logit_bias={9: 1, 2: -100}, min_tokens=16, max_tokens=16, logprobs=20)
    assert params.logit_bias == ((2, -100.0), (9, 1.0)) and hash(params) == hash(SamplingParams(**{
        "logit_bias": [(9, 1.0), (2, -100)], "min_tokens": 16, "max_tokens": 16, "logprobs": 20}))
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert params.needs_penalties and not params.needs_history
    assert SamplingParams(repetition_penalty=1.1).needs_history
    assert not SamplingParams().needs_penalties
    with pytest.raises(SamplingParamsError, match="logit_bias: token id 10 is outside the vocabulary"):
        SamplingParams(logit_bias={10: 1.0}).check_token_ids(10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(12,)).check_token_ids(10)
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=(9,)).check_token_ids(10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 32000, generator=gen) * 3
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=40, top_p=0.9, logprobs=5),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, repetition_penalty=1.3, min_tokens=5)]
    rows = [SamplingRow(params[i % 4], i, (0,), i % 7, (1, 2, 3), (4, 5)) for i in range(256)]
    cpu = Sampler(32000, "cpu", (EOS,)).sample(logits, rows)
    cuda = Sampler(32000, "cuda", (EOS,)).sample(logits.cuda(), rows)
    assert cuda.token_ids() == cpu.token_ids()
    for cpu_row, cuda_row in zip(cpu.logprobs(), cuda.logprobs()):
        for a, b in zip(cpu_row, cuda_row):
            assert (a is None) == (b is None)
            if a is not None:
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
