"""`pagedkv bench hf --only sharing`: KV memory of beams and samples that share blocks, against DynamicCache.

The vLLM paper's memory argument (section 4.4, figure 15): beams and parallel samples of one
prompt share its KV blocks, where a contiguous cache copies them per sequence. vLLM reports
37.6-55.2% less KV memory from sharing in beam search and 6.1-9.8% in parallel sampling.

Scenarios (512-token prompts, 128 new tokens, 4 beams or 4 samples, batch 1 and 8):

- beam search, `generate(num_beams=4)`: transformers expands the prompt before prefill, so
  both caches prefill 4 copies; each `reorder_cache` then forks block tables, and beams hold
  their common prefix once. DynamicCache's `index_select` copies every beam.
- parallel sampling, `generate(do_sample=True, num_return_sequences=4)`: no reorder ever
  happens, so the 4 prefilled copies stay apart (no sharing; shown as is).
- parallel sampling, shared prefill: the prompt is prefilled once and
  `batch_repeat_interleave(4)` forks it (DynamicCache repeats its tensors).
- prompt reuse (HF's recipe): one cached 512-token prompt, `copy.deepcopy` per request,
  8 requests generating 128 tokens each, all kept alive.

Memory is sampled after every forward (a stopping criterion that never stops): DynamicCache
as the bytes of its key/value tensors, PagedCache as the distinct blocks its rows hold, and
as the blocks they would hold unshared (the vLLM paper's "saving" is 1 - shared / unshared).
Sampled runs are seeded identically for both caches, so they choose the same tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

SCENARIOS = ("beam search", "parallel sampling", "parallel sampling, shared prefill")
#: vLLM paper (Kwon et al., SOSP 2023), section 6.3: KV memory saved by sharing.
VLLM_ANCHORS = {"beam search": (0.376, 0.552), "parallel sampling": (0.061, 0.098)}


def _dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


class _Probe:
    """A stopping criterion that samples KV memory after every forward and never stops generation."""

    def __init__(self, measure):
        self.measure = measure
        self.samples: list[tuple[int, int]] = []  # (bytes held, bytes if nothing were shared)

    def __call__(self, input_ids, scores, **kwargs):
        self.samples.append(self.measure())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _run(model, pool, scenario: str, paged: bool, ids: torch.Tensor, new_tokens: int, width: int) -> tuple:
    """One generate call; returns (memory samples, output ids)."""
    from transformers import DynamicCache, StoppingCriteriaList

    from pagedkv.hf.cache import PagedCache

    model.set_attn_implementation("pagedkv" if paged else "sdpa")
    cache = PagedCache(pool) if paged else DynamicCache()
    block_bytes = pool.kv.bytes_per_block
    if paged:
        def measure():
            memory = cache.memory()
            return memory.num_blocks * block_bytes, memory.num_unshared_blocks * block_bytes
    else:
        def measure():
            held = _dynamic_bytes(cache)
            return held, held
    probe = _Probe(measure)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  past_key_values=cache, pad_token_id=0, eos_token_id=None, disable_compile=True,
                  stopping_criteria=StoppingCriteriaList([probe]))
    if scenario == "beam search":
        kwargs.update(num_beams=width, do_sample=False)
    else:
        kwargs.update(num_return_sequences=width, do_sample=True, temperature=1.0)
    with torch.no_grad():
        if scenario == "parallel sampling, shared prefill":
            # generate feeds the uncached last prompt token itself
            model(ids[:, :-1], past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(width)
            probe.samples.append(measure())
        torch.manual_seed(0)
        out = model.generate(ids, **kwargs)
    if paged:
        cache.free()
    model.set_attn_implementation("pagedkv")
    return probe.samples, out


def _prompt_reuse(model, pool, prompt_len: int, new_tokens: int, num_requests: int, vocab: int) -> dict:
    """HF's prompt-reuse recipe: bytes held with one cached prompt and `num_requests` deep copies alive."""
    from transformers import DynamicCache

    from pagedkv.hf.cache import PagedCache

    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen).to(model.device)
    suffixes = [torch.randint(0, vocab, (1, 4), generator=gen).to(model.device) for _ in range(num_requests)]
    result = {}
    for paged in (False, True):
        model.set_attn_implementation("pagedkv" if paged else "sdpa")
        prompt_cache = PagedCache(pool) if paged else DynamicCache()
        with torch.no_grad():
            model(prompt, past_key_values=prompt_cache, use_cache=True)
        copies = []
        for suffix in suffixes:
            ids = torch.cat([prompt, suffix], dim=1)
            copies.append(copy.deepcopy(prompt_cache))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, past_key_values=copies[-1], pad_token_id=0,
                           eos_token_id=None, disable_compile=True)
        if paged:
            result["paged_bytes"] = pool.num_used_blocks * pool.kv.bytes_per_block
            result["paged_unshared_bytes"] = sum(c.memory().num_unshared_blocks
                                                 for c in [prompt_cache, *copies]) * pool.kv.bytes_per_block
            for cache in [prompt_cache, *copies]:
                cache.free()
        else:
            result["dynamic_bytes"] = sum(_dynamic_bytes(c) for c in [prompt_cache, *copies])
    model.set_attn_implementation("pagedkv")
    result["saving_vs_dynamic"] = 1 - result["paged_bytes"] / result["dynamic_bytes"]
    result["sharing_saving"] = 1 - result["paged_bytes"] / result["paged_unshared_bytes"]
    return result


def _summary(dynamic: list[tuple[int, int]], paged: list[tuple[int, int]]) -> dict:
    """End-of-run, time-averaged and peak figures of one scenario (the first sample is right after prefill)."""
    dyn = [held for held, _ in dynamic]
    held = [h for h, _ in paged]
    unshared = [u for _, u in paged]
    return {
        "dynamic_end_bytes": dyn[-1], "paged_end_bytes": held[-1], "paged_unshared_end_bytes": unshared[-1],
        "dynamic_peak_bytes": max(dyn), "paged_peak_bytes": max(held),
        "saving_vs_dynamic_end": 1 - held[-1] / dyn[-1],
        "saving_vs_dynamic_mean": 1 - sum(held) / sum(dyn),
        "sharing_saving_end": 1 - held[-1] / unshared[-1],
        "sharing_saving_mean": 1 - sum(held) / sum(unshared),
        "dynamic_curve_bytes": dyn, "paged_curve_bytes": held, "paged_unshared_curve_bytes": unshared,
    }


def measure_sharing(model, pool, batches=(1, 8), prompt_len: int = 512, new_tokens: int = 128, width: int = 4,
                    num_reuse_requests: int = 8) -> dict:
    """Every scenario at every batch size; returns the JSON-ready result."""
    vocab = model.config.vocab_size
    rows = []
    for scenario in SCENARIOS:
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(model.device)
            dynamic, dyn_out = _run(model, pool, scenario, False, ids, new_tokens, width)
            paged, paged_out = _run(model, pool, scenario, True, ids, new_tokens, width)
            rows.append({"scenario": scenario, "batch": batch, "num_sequences": batch * width,
                         "same_tokens": bool(torch.equal(dyn_out, paged_out)), **_summary(dynamic, paged)})
    reuse = _prompt_reuse(model, pool, prompt_len, new_tokens, num_reuse_requests, vocab)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "width": width, "block_size": pool.block_size,
            "bytes_per_token": pool.bytes_per_token, "vllm_anchors": VLLM_ANCHORS, "rows": rows,
            "prompt_reuse": {"num_requests": num_reuse_requests, **reuse}}


def table_lines(result: dict) -> list[str]:
    """The markdown table of `measure_sharing`'s result."""
    mb = 1e6
    lines = ["| scenario | batch | seqs | DynamicCache MB (end) | PagedCache MB (end) | less than DynamicCache "
             "(end / mean) | sharing saving, vLLM's measure (end / mean) | peak MB Dynamic / Paged | same tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        lines.append(
            f"| {row['scenario']} | {row['batch']} | {row['num_sequences']} | {row['dynamic_end_bytes'] / mb:.1f} | "
            f"{row['paged_end_bytes'] / mb:.1f} | {row['saving_vs_dynamic_end']:.1%} / "
            f"{row['saving_vs_dynamic_mean']:.1%} | {row['sharing_saving_end']:.1%} / {row['sharing_saving_mean']:.1%} | "
            f"{row['dynamic_peak_bytes'] / mb:.1f} / {row['paged_peak_bytes'] / mb:.1f} | {row['same_tokens']} |")
    reuse = result["prompt_reuse"]
    lines.append(f"| prompt reuse (deepcopy x{reuse['num_requests']}) | 1 | {reuse['num_requests']} | "
                 f"{reuse['dynamic_bytes'] / mb:.1f} | {reuse['paged_bytes'] / mb:.1f} | "
                 f"{reuse['saving_vs_dynamic']:.1%} | {reuse['sharing_saving']:.1%} | | |")
    return lines


def plot(result: dict, path: Path, title: str) -> str:
    """Left: KV memory against decode step (beam search, largest batch). Right: savings per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = 1e6
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4))
    beams = [r for r in result["rows"] if r["scenario"] == "beam search"][-1]
    steps = range(len(beams["dynamic_curve_bytes"]))
    left.plot(steps, [b / mb for b in beams["dynamic_curve_bytes"]], color="tab:orange",
              label="DynamicCache (a copy per beam)")
    left.plot(range(len(beams["paged_unshared_curve_bytes"])),
              [b / mb for b in beams["paged_unshared_curve_bytes"]], color="tab:gray", linestyle="--",
              label="PagedCache if nothing were shared")
    left.plot(range(len(beams["paged_curve_bytes"])), [b / mb for b in beams["paged_curve_bytes"]],
              color="tab:blue", label="PagedCache (shared blocks once)")
    left.set_xlabel("forward pass (0 = prefill)")
    left.set_ylabel("KV memory (MB)")
    left.set_title(f"beam search, batch {beams['batch']} x {result['width']} beams")
    left.legend(fontsize=8)

    labels, vs_dynamic, sharing = [], [], []
    for row in result["rows"]:
        labels.append(f"{row['scenario']}\nbatch {row['batch']}".replace("parallel sampling", "sampling")
                      .replace(", shared prefill", "\nshared prefill"))
        vs_dynamic.append(100 * row["saving_vs_dynamic_mean"])
        sharing.append(100 * row["sharing_saving_mean"])
    reuse = result["prompt_reuse"]
    labels.append(f"prompt reuse\n(deepcopy x{reuse['num_requests']})")
    vs_dynamic.append(100 * reuse["saving_vs_dynamic"])
    sharing.append(100 * reuse["sharing_saving"])
    x = range(len(labels))
    right.bar([i - 0.2 for i in x], vs_dynamic, width=0.4, zorder=3, label="less KV than DynamicCache (time mean)")
    right.bar([i + 0.2 for i in x], sharing, width=0.4, zorder=3, label="saved by sharing (vLLM's measure, time mean)")
    for name, (low, high) in VLLM_ANCHORS.items():
        color = "tab:green" if name == "beam search" else "tab:purple"
        right.axhspan(100 * low, 100 * high, color=color, alpha=0.2, zorder=1, label=f"vLLM paper, {name}")
    right.set_xticks(list(x))
    right.set_xticklabels(labels, fontsize=7)
    right.set_ylabel("% of KV memory saved")
    right.set_ylim(min(0, *vs_dynamic) - 5, 100)
    right.legend(fontsize=7, loc="upper left", ncols=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
