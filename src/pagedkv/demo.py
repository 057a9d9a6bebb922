"""`pagedkv demo`: the main job, shown to a person.

`engine_demo` answers chat prompts with the embedded SmolLM2-135M-Instruct through the
continuous-batching engine, then shows what paging did and checks the answers against HF
`generate`. `memory_demo` runs the paging core alone (a mixed workload, naive vs paged
reservation, a block-size sweep), with no model.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from pagedkv.cli import ArgumentParser
from pagedkv.core import BlockAllocator, BlockTable, ModelSpec, generate_lengths, memory_report

SMOLLM2_SPEC = ModelSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, name="SmolLM2-135M (bf16)")


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.2f} MB"


def memory_demo(num_seqs: int = 32, seed: int = 42, max_seq_len: int = 2048, block_size: int = 16,
                num_blocks: int = 4096, spec: ModelSpec = SMOLLM2_SPEC, console: Console | None = None) -> dict:
    """Place a mixed workload in a real allocator, then compare naive and paged reservation."""
    console = console or Console()
    lengths = generate_lengths(num_seqs, seed=seed)
    allocator = BlockAllocator(num_blocks)
    tables = []
    for length in lengths:
        table = BlockTable(allocator, block_size, max_num_tokens=max_seq_len)
        table.append_tokens(length)
        tables.append(table)
    allocator.check_integrity()
    report = memory_report(lengths, block_size, max_seq_len, spec.bytes_per_token)
    assert allocator.num_used == report.num_blocks, "allocator and accounting disagree"

    console.print(f"[bold]Workload[/bold]: {num_seqs} sequences, seed {seed}, lengths "
                  f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}), "
                  f"max_seq_len {max_seq_len}, model {spec.name}: {spec.bytes_per_token:,} B/token")
    table = Table(title="KV memory: naive contiguous vs paged")
    for column in ("", "naive", "paged"):
        table.add_column(column, justify="right")
    table.add_row("reserved tokens", f"{report.naive_reserved_tokens:,}", f"{report.paged_reserved_tokens:,}")
    table.add_row("reserved memory", _mb(report.naive_reserved_bytes), _mb(report.paged_reserved_bytes))
    table.add_row("utilization", f"{report.naive_utilization:.1%}", f"{report.paged_utilization:.1%}")
    table.add_row("blocks in pool", "-", f"{allocator.num_used} / {num_blocks}")
    table.add_row("fragmentation / seq", "-", f"{report.fragmentation_per_seq:.2f} tokens "
                  f"(expected ~{(block_size - 1) / 2:.1f})")
    table.add_row("savings", "1.00x", f"{report.savings:.2f}x")
    console.print(table)

    sweep = Table(title="Block-size sweep (the page-size trade-off)")
    for column in ("block size", "reserved", "fragmentation", "utilization", "table entries / seq"):
        sweep.add_column(column, justify="right")
    sweep_rows = []
    for size in (1, 16, 64, 256):
        r = memory_report(lengths, size, max_seq_len, spec.bytes_per_token)
        sweep_rows.append({"block_size": size, "reserved_bytes": r.paged_reserved_bytes,
                           "fragmentation_bytes": r.fragmentation_bytes, "utilization": r.paged_utilization,
                           "table_entries_per_seq": r.table_entries_per_seq})
        sweep.add_row(str(size), _mb(r.paged_reserved_bytes), _mb(r.fragmentation_bytes),
                      f"{r.paged_utilization:.1%}", str(r.table_entries_per_seq))
    console.print(sweep)

    for t in tables:
        t.free()
    allocator.check_integrity()
    console.print(f"All {num_seqs} sequences freed: {allocator.num_used} blocks in use, "
                  f"peak {allocator.peak_used}.")
    return {"lengths": lengths, "naive_reserved_bytes": report.naive_reserved_bytes,
            "paged_reserved_bytes": report.paged_reserved_bytes, "sweep": sweep_rows}


DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the ocean.",
    "What does a CPU do?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.",
]


def engine_demo(model: str | None = None, max_tokens: int = 48, device: str | None = None,
                verify: bool = True, console: Console | None = None) -> dict:
    """Answer DEMO_QUESTIONS through the engine; print answers, a paging table and the HF check."""
    import time

    import torch
    from transformers import DynamicCache

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    console = console or Console()
    with console.status("loading the model (the first run converts the GGUF weights once)..."):
        started = time.perf_counter()
        llm = LLM(model, device=device)
        load_seconds = time.perf_counter() - started
    engine = llm.engine
    console.print(f"[bold]Model[/bold] {model or 'SmolLM2-135M-Instruct (embedded GGUF)'} on {engine.device}, "
                  f"{engine.dtype}, loaded in {load_seconds:.1f} s. KV pool: {engine.scheduler.block_manager.num_blocks} blocks x "
                  f"{engine.pool.block_size} tokens, max_model_len {engine.max_model_len}.")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts, note = demo_prompts(llm)
    if note:
        console.print(f"[yellow]{note}[/yellow]")
    # One question first, then the rest together: the chat template's shared system prompt is
    # then in the prefix cache, and the batch shares its blocks instead of recomputing them.
    started = time.perf_counter()
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params, use_tqdm=True)
    wall = time.perf_counter() - started
    for question, output in zip(DEMO_QUESTIONS, outputs):
        completion = output.outputs[0]
        answer = completion.text.strip() if llm.tokenizer is not None else f"token ids {completion.token_ids}"
        console.print(f"[bold cyan]Q:[/bold cyan] {question}\n[bold green]A:[/bold green] {answer}")

    stats = llm.stats()
    lengths = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs]
    bytes_per_block = engine.pool.bytes_per_block
    naive_blocks = len(outputs) * -(-engine.max_model_len // engine.pool.block_size)
    report = memory_report(lengths, engine.pool.block_size, engine.max_model_len)
    table = Table(title="What paging did")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("requests", str(len(outputs)))
    table.add_row("peak KV blocks used (paged)", f"{stats['peak_used_blocks']} "
                  f"({stats['peak_used_blocks'] * bytes_per_block / 2**20:.1f} MiB)")
    table.add_row("naive reservation (max_model_len each)", f"{naive_blocks} blocks "
                  f"({naive_blocks * bytes_per_block / 2**20:.1f} MiB)")
    table.add_row("utilization of held blocks", f"{report.paged_utilization:.1%}")
    table.add_row("utilization under naive", f"{report.naive_utilization:.2%}")
    table.add_row("preemptions", str(stats["num_preemptions"]))
    table.add_row("prefix-cache hits", f"{stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} blocks "
                  f"({stats['prefix_cache_hit_tokens']} tokens not recomputed)")
    table.add_row("generated tokens", str(stats["num_generated_tokens"]))
    table.add_row("throughput", f"{stats['num_generated_tokens'] / wall:.1f} tokens/s "
                  f"({stats['tokens_per_second']:.1f} in engine steps)")
    table.add_row("KV blocks in use after the run", str(stats["num_used_blocks"]))
    console.print(table)

    result = {"outputs": [o.outputs[0].text for o in outputs], "stats": stats, "matches_hf": None}
    if verify:
        model_sdpa = engine.hf_model
        matches = 0
        with console.status("checking against HF generate (DynamicCache, sdpa), one prompt at a time..."):
            model_sdpa.set_attn_implementation("sdpa")
            try:
                for prompt, output in zip(prompts, outputs):
                    ids = torch.tensor([prompt], device=engine.device)
                    reference = model_sdpa.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=max_tokens, past_key_values=DynamicCache(),
                                                    pad_token_id=model_sdpa.generation_config.pad_token_id)
                    expected = reference[0, len(prompt):].tolist()
                    eos = engine.scheduler.eos_token_ids
                    matches += output.outputs[0].token_ids == _trim_after_eos(expected, eos)
            finally:
                model_sdpa.set_attn_implementation("pagedkv")
        ok = matches == len(outputs)
        console.print(f"[bold]{'OK' if ok else 'MISMATCH'}[/bold]: greedy outputs equal HF generate's for "
                      f"{matches}/{len(outputs)} prompts.")
        result["matches_hf"] = ok
    return result


def demo_prompts(llm) -> tuple[list[list[int]], str | None]:
    """Token ids of DEMO_QUESTIONS for this model, and a note when they are not chat turns.

    A chat template makes each question a user turn; a tokenizer without one gets the plain
    question; a model without a tokenizer (random:NAME) gets each question's UTF-8 bytes as
    token ids, so paging and the HF check still run, on token ids instead of text.
    """
    tokenizer = llm.tokenizer
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None:
        return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in DEMO_QUESTIONS], None
    if tokenizer is not None:
        return ([llm.engine.tokenize(q)[1] for q in DEMO_QUESTIONS],
                "This tokenizer has no chat template: the questions go in as plain prompts.")
    vocab = llm.engine.vocab_size
    # NOTE: ids from 3 up, past the usual special tokens (pad/bos/eos), so no prompt ends itself.
    prompts = [[3 + byte % (vocab - 3) for byte in q.encode("utf-8")] for q in DEMO_QUESTIONS]
    return prompts, ("This model has random weights and no tokenizer: each question goes in as its UTF-8 bytes "
                     "(as token ids), and the answers are token ids.")


def _trim_after_eos(tokens: list[int], eos_ids) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


def main(argv: list[str] | None = None, prog: str = "pagedkv demo") -> int:
    """`pagedkv demo`: the engine demo on the embedded model, or `--memory` for the paging core alone."""
    parser = ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("--memory", action="store_true", help="the paging-core memory demo only (no model)")
    parser.add_argument("--model", default=None, help="HF id, path, .gguf or random:NAME (a model without a "
                        "tokenizer answers in token ids) (default: embedded)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    parser.add_argument("--no-verify", action="store_true", help="skip the check against HF generate")
    parser.add_argument("--seqs", type=int, default=32, help="sequences in the memory demo (default 32)")
    parser.add_argument("--seed", type=int, default=42, help="workload seed of the memory demo (default 42)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block, memory demo (default 16)")
    args = parser.parse_args(argv)
    if args.memory:
        memory_demo(num_seqs=args.seqs, seed=args.seed, block_size=args.block_size)
        return 0
    result = engine_demo(args.model, max_tokens=args.max_tokens, device=args.device, verify=not args.no_verify)
    return 0 if result["matches_hf"] in (True, None) else 1
