"""The chat-tiers benchmark's report: its results as markdown, each figure beside its target.

`pagedkv.bench.engine_chat_tiers` measures; this module only formats. Targets: TTFT P50 and P99
at least 3x lower than GPU-only prefix caching, output tok/s not lower, a restore rate of at
least 80% of the pinned host-to-device bandwidth measured in the same run, and after a restart
at least 90% of prompt blocks served from disk. Beside the TTFT target stands what is possible at
all: one turn's prefill against copying its prefix plus its user message's prefill.
"""

from __future__ import annotations

from pagedkv.engine.outputs import STEP_PHASES


#: The tiered configuration the targets judge, the optional ones without its disk tier and with disk writes free to
#: start while the step loop runs, and the name of the optional one with another in-step restore cap.
TIERED = "GPU + host + disk"
HOST_ONLY = "GPU + host (no disk tier)"
WRITES_DURING_STEPS = f"{TIERED}, disk writes during steps"
WRITER_PROCESS = f"{TIERED}, disk writer process"
LATE_RESTORE = f"{TIERED}, restores issued with the step"
WRITE_THROUGH = f"{TIERED}, write-through"


def in_step_label(tokens: int) -> str:
    """The configuration whose steps copy at most `tokens` tokens' worth of restored blocks before their kernels."""
    return f"{TIERED}, in-step restores <= {tokens} tokens"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gbps(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e9:.1f}"


def _share(part: float | None, whole: float) -> str:
    return "-" if part is None or not whole else f"{part / whole * 100:.0f}%"


def _graphs(mode: str) -> str:
    """How the run's steps used CUDA graphs, in words."""
    return {"full": "every step replays a CUDA graph (attention inside)",
            "piecewise": "decode steps graphed, prefill steps graphed piecewise (attention eager)"}.get(
        mode, "prefill steps eager, decode steps graphed")


def _header(name: str, model: dict) -> list[str]:
    w = model["workload"]
    return [f"## random:{name}: {w['num_conversations']} conversations x {w['num_turns']} turns over "
            f"{w['num_system_prompts']} system prompts of {w['system_prompt_tokens']} tokens, {model['max_num_seqs']} "
            f"turns in flight; GPU pool {model['num_blocks']} blocks = "
            f"{model['gpu_pool_share_of_prefixes'] * 100:.0f}% of the {model['distinct_prefix_blocks']} distinct "
            f"prefix blocks the turns reuse (target ~10%), host tier {model['host_bytes'] / 2**30:g} GiB; "
            f"{_graphs(model.get('mixed_step_graphs', 'off'))}, in every configuration; same prompts in every "
            f"configuration: "
            f"{'yes' if model['same_prompts'] else 'NO'}", "",
            "| config | TTFT P50 ms | TTFT P99 ms | output tok/s | GPU hits | host hits | disk hits | restored GB | "
            "H2D copy GB/s | with scatter GB/s | blocks per copy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _row(label: str, row: dict) -> str:
    per_copy = row["blocks_per_h2d_copy"]
    return (f"| {label} | {_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} | {row['output_tokens_per_s']:,.0f} | "
            f"{row['gpu_hit_rate'] * 100:.0f}% | {row['host_hit_rate'] * 100:.0f}% | {row['disk_hit_rate'] * 100:.0f}% | "
            f"{row['kv_h2d_bytes'] / 1e9:.2f} | {_gbps(row['restore_copy_bytes_per_s'])} | "
            f"{_gbps(row['restore_bytes_per_s'])} | {'-' if per_copy is None else f'{per_copy:.1f}'} |")


def step_line(steps: dict) -> str:
    """One line: the phases' host seconds and the slowest step, its longest phase and its shape."""
    text = (f"{steps['num_steps']} steps, host s: schedule {steps['schedule_s']:.2f}, build {steps['build_s']:.2f}, "
            f"launch {steps['launch_s']:.2f}, wait {steps['wait_s']:.2f}, update {steps['update_s']:.2f}")
    if steps["slowest"]:
        top = steps["slowest"][0]
        phase = max(STEP_PHASES, key=lambda p: top[p])
        shape = top["shape"]
        text += (f"; slowest step {top['total_s'] * 1e3:.1f} ms ({phase[:-2]} {top[phase] * 1e3:.1f} ms; "
                 f"{shape['prefill_tokens']} prefill tokens, {shape['decode_seqs']} decodes, "
                 f"{shape['restored_blocks'] + shape['restored_in_step_blocks']} restored and "
                 f"{shape['offloaded_blocks'] + shape['pre_spilled_blocks']} spilled blocks)")
    return text


def parts_line(parts: dict) -> str:
    """`chat_tiers_run.ttft_parts` in words (means over the turns, ms)."""
    return (f"mean {_ms(parts['ttft_s'])} ms over {parts['num_turns']} turns = {parts['steps']:.1f} step calls: "
            f"schedule {_ms(parts['schedule_s'])}, build {_ms(parts['build_s'])}, launch {_ms(parts['launch_s'])}, "
            f"wait {_ms(parts['wait_s'])}, update {_ms(parts['update_s'])}, in steps with nothing to compute "
            f"{_ms(parts['untimed_s'])}, between the calls {_ms(parts['between_steps_s'])}")


def slowest_turns_line(turns: list[dict], count: int = 3) -> str:
    """The `count` slowest turns that reuse a system prompt, each with what its steps did and the turn submitted
    before it (a cold one leaves blocks that the next turn's restore evicts)."""
    before = {turn["id"]: turns[i - 1] if i else None for i, turn in enumerate(turns)}
    warm = sorted((t for t in turns if t["reuse"]), key=lambda t: t["ttft_s"], reverse=True)[:count]
    parts = []
    for t in warm:
        prior = before[t["id"]]
        parts.append(f"{t['id']} {_ms(t['ttft_s'])} ms ({t['steps']} steps, wait {_ms(t['wait_s'])} ms, untimed "
                     f"{_ms(t.get('untimed_s'))} ms, restored "
                     f"{t['restored'] + t['restored_in_step']}, spilled {t['spilled']}, pre-spilled "
                     f"{t['pre_spilled']}, {t['prefill_tokens']} prefill tokens; after "
                     f"{'nothing' if prior is None else ('a warm' if prior['reuse'] else 'a cold') + ' turn'})")
    return "; ".join(parts) if parts else "-"


def _verdict(value: float | None, target: float) -> str:
    return "-" if value is None else ("met" if value >= target else "missed")


def _summary(model: dict) -> list[str]:
    gpu, tiers = model["configs"]["GPU only"], model["configs"][TIERED]
    p50, p99 = gpu["ttft_p50_s"] / tiers["ttft_p50_s"], gpu["ttft_p99_s"] / tiers["ttft_p99_s"]
    throughput = tiers["output_tokens_per_s"] / gpu["output_tokens_per_s"]
    lines = [f"- TTFT vs GPU-only: P50 {p50:.2f}x lower, P99 {p99:.2f}x lower (target >= 3x: "
             f"{_verdict(min(p50, p99), 3.0)}); output tok/s {throughput:.2f}x (target >= 1x: "
             f"{_verdict(throughput, 1.0)})"]
    if tiers.get("ttft_reuse_p50_s") and gpu.get("ttft_reuse_p50_s"):
        r50 = gpu["ttft_reuse_p50_s"] / tiers["ttft_reuse_p50_s"]
        r99 = gpu["ttft_reuse_p99_s"] / tiers["ttft_reuse_p99_s"]
        lines.append(f"- Over the {tiers['num_reuse_requests']} of {tiers['num_requests']} turns whose system prompt "
                     f"an earlier turn sent (a system prompt's first use is a cold prefill in every configuration): "
                     f"TTFT P50 {_ms(gpu['ttft_reuse_p50_s'])} -> {_ms(tiers['ttft_reuse_p50_s'])} ms, {r50:.2f}x "
                     f"lower; P99 {_ms(gpu['ttft_reuse_p99_s'])} -> {_ms(tiers['ttft_reuse_p99_s'])} ms, {r99:.2f}x "
                     f"lower (target >= 3x: {_verdict(min(r50, r99), 3.0)})")
    for label, row in model["configs"].items():
        if label == HOST_ONLY or label.startswith(f"{TIERED}, "):  # tiers without disk, or another in-step cap
            lines.append(f"- {label}: TTFT P50 {gpu['ttft_p50_s'] / row['ttft_p50_s']:.2f}x lower than GPU-only, P99 "
                         f"{gpu['ttft_p99_s'] / row['ttft_p99_s']:.2f}x; output tok/s "
                         f"{row['output_tokens_per_s'] / gpu['output_tokens_per_s']:.2f}x")
    bound = model.get("restore_bound")
    if bound:
        lines.append(f"- What is possible: a turn with a {bound['prefix_tokens']}-token prefix and a "
                     f"{bound['user_tokens']}-token message prefills in {_ms(bound['prefill_s'])} ms on an idle "
                     f"engine; copying the prefix at {_gbps(bound['h2d_bytes_per_s'])} GB/s takes "
                     f"{_ms(bound['copy_s'])} ms and the message's prefill {_ms(bound['user_prefill_s'])} ms, so its "
                     f"TTFT can fall at most {bound['max_ttft_gain']:.2f}x (the prefix recomputes "
                     f"{bound['recompute_over_copy']:.1f}x slower than it copies). GPU-only already serves "
                     f"{gpu['gpu_hit_rate'] * 100:.0f}% of the blocks that could hit; only the rest can gain.")
    if "pinned_bandwidth" in model:
        pinned = model["pinned_bandwidth"]["h2d_bytes_per_s"]
        copy_rate, rate = tiers["restore_copy_bytes_per_s"], tiers["restore_bytes_per_s"]
        lines.append(f"- Pinned copy bandwidth in this run: H2D {_gbps(pinned)} GB/s, D2H "
                     f"{_gbps(model['pinned_bandwidth']['d2h_bytes_per_s'])} GB/s. Restores: the H2D copies alone "
                     f"{_gbps(copy_rate)} GB/s = {_share(copy_rate, pinned)} of H2D (target >= 80%: "
                     f"{_verdict(None if copy_rate is None else copy_rate / pinned, 0.8)}); with the scatter into "
                     f"the pool {_gbps(rate)} GB/s = {_share(rate, pinned)}")
    for label, row in model["configs"].items():
        if "steps" in row:
            lines.append(f"- Steps, {label}: {step_line(row['steps'])}")
    for label, row in model["configs"].items():
        if row.get("ttft_reuse_parts"):
            lines.append(f"- Warm turns' TTFT by part, {label}: {parts_line(row['ttft_reuse_parts'])}")
    for label, row in model["configs"].items():
        if row.get("turns"):
            lines.append(f"- Slowest warm turns, {label}: {slowest_turns_line(row['turns'])}")
    if "warm_up_s" in model:
        lines.append(f"- Before the configurations, the whole workload of another seed ran once through the tiers "
                     f"({model['warm_up_s']:.1f} s), so that Triton's compiles stay out of the measured runs")
    r = model["restart"]
    lines.append(f"- Restart: of the {r['distinct_blocks']} distinct prompt blocks of {r['num_requests']} replayed "
                 f"turns, {r['disk_share'] * 100:.1f}% read from disk (target >= 90%: "
                 f"{_verdict(r['disk_share'], 0.9)}) and {r['not_computed_share'] * 100:.1f}% not computed (read "
                 f"from disk, or shared on the GPU after another prompt read them); per request "
                 f"{r['request_disk_share'] * 100:.1f}% of prompt blocks were disk hits. {r['disk_load_misses']} bad "
                 f"files, first request TTFT {_ms(r['first_ttft_s'])} ms, engine startup {r['startup_s']:.1f} s")
    return lines


def markdown(result: dict) -> str:
    """The results as markdown: per model a table of the three configurations and the lines with the targets."""
    p = result["provenance"]
    lines = [f"# KV tiers on multi-turn chat ({p.get('device')}, {p['date']}, commit {p['commit']})", ""]
    for name, model in result["models"].items():
        lines += _header(name, model)
        lines += [_row(label, row) for label, row in model["configs"].items()]
        lines += [""] + _summary(model) + [""]
    return "\n".join(lines)
