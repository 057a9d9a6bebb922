"""The report of `pagedkv bench kernel`: the target summary, `kernel.md` and the console tables.

Each section returns its rows; this module gathers every target with its measured figure
(met, MISSED, or report only) and writes the markdown that mirrors the console.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.kernel_common import fmt
from pagedkv.bench.kernel_decode import table_rows as decode_table_rows


def verdict(met: bool | None) -> str:
    """'met', 'MISSED', or 'report' for a figure the issue asks to report without a threshold."""
    return "report" if met is None else "met" if met else "MISSED"


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A GitHub markdown table as lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |"
                                                                           for c in body]


def target_summary(result: dict) -> list[dict]:
    """Every target of issues 3 and 12 with its measured figure: {target, measured, met (None: report only)}."""
    summary = []
    for row in result["decode"]:
        if row["order"] != "shuffled" or row["page"] != 16:
            continue
        for text in row["targets"]:
            name, _, rest = text.partition(": ")
            summary.append({"target": f"decode B={row['batch']} x {row['seq_len']}: {name}",
                            "met": rest.startswith("met"), "measured": rest.partition(" ")[2].strip("()")})
    prefill = result["prefill"]
    best = max((r for r in result.get("prefill_contenders", [prefill]) if r.get("tflops")),
               key=lambda r: r["tflops"], default=prefill)
    sdpa = prefill.get("sdpa_causal_tflops")
    ratio = best["tflops"] / sdpa if best.get("tflops") and sdpa else None
    summary.append({"target": f"prefill {prefill['batch']} x {prefill['seq_len']} causal: >=0.85x SDPA "
                              f"({prefill.get('sdpa_backend', '')})",
                    "met": bool(ratio and ratio >= 0.85),
                    "measured": f"{fmt(ratio)}x ({fmt(best.get('tflops'), '.0f')} vs {fmt(sdpa, '.0f')} TFLOP/s, "
                                f"{best.get('label', best.get('kernel', 'prefill'))})"})
    summary += result.get("step_targets", [])
    summary += result.get("fp8_targets", [])
    return summary


def write_markdown(path: Path, result: dict) -> Path:
    """`kernel.md`: provenance, the targets, then the same tables the console shows."""
    prov = result["provenance"]
    lines = ["# pagedkv bench kernel", "",
             (f"Device: {prov['device']}; date: {prov['date']}; commit: {prov['commit']}; "
              f"dtype {result['dtype']}; Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128) "
              f"unless a row names another model."), "",
             f"Measured copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s", "",
             "Times are medians of CUDA-graph replays (do_bench, L2 flushed between calls) for every pagedkv "
             "contender and SDPA / gather+SDPA alike; 'eager TB/s' is the default decode launched from Python, "
             "whose host launch cost shows in the small cases. FlexAttention is timed eagerly.", ""]
    lines += ["## Targets", ""] + markdown_table(
        ["target", "measured", "met"], [[t["target"], t["measured"], verdict(t["met"])]
                                        for t in result["target_summary"]]) + [""]
    if result.get("validation"):
        lines += ["## Validation (Triton vs float64 reference)", ""] + markdown_table(
            ["kernel", "contender", "case", "max abs err", "ok"],
            [[r["kernel"], r.get("contender", "default"), r["case"], f"{r['max_abs_err']:.2e}", str(r["ok"])]
             for r in result["validation"]]) + [""]
    if result.get("fp8_decode"):
        from pagedkv.bench.kernel_fp8 import table_rows

        lines += ["## FP8 decode (against the model-dtype cache, same data, same run)", ""] + markdown_table(
            *table_rows(result["fp8_decode"])) + [""]
    header, body = decode_table_rows(result["decode"])
    lines += ["## Decode", ""] + markdown_table(header, body)
    w, p = result["write_kv"], result["prefill"]
    lines += ["", f"write_kv, {w['num_tokens']} tokens to random slots: {fmt(w['tbps'])} TB/s (read + write)",
              (f"prefill, {p['batch']} x {p['seq_len']} causal: {fmt(p['tflops'], '.1f')} TFLOP/s "
               f"(contiguous causal SDPA, {p.get('sdpa_backend', '')}: {fmt(p['sdpa_causal_tflops'], '.1f')} "
               f"TFLOP/s)"), ""]
    if result.get("flashinfer"):
        from pagedkv.bench.kernel_flashinfer import markdown

        lines += markdown(result["flashinfer"])
    for title, key in (("Engine shapes", "engine_shapes"), ("Chunked prefill", "chunked_prefill"),
                       ("Mixed step", "mixed_step")):
        section = result.get("steps", {}).get(key)
        if section:
            lines += [f"## {title}", "", section["note"], ""] + markdown_table(section["header"], section["body"])
            lines.append("")
    if result.get("variants"):
        lines += ["## Variants", ""] + markdown_table(
            ["shape", "variant", "TB/s"], [[r["shape"], r["variant"], fmt(r["tbps"], ".2f", r["error"] or "n/a")]
                                           for r in result["variants"]["decode"]])
        lines += [""] + markdown_table(
            ["prefill variant", "kernel", "TFLOP/s"],
            [[r["variant"], r.get("kernel", "prefill"), fmt(r["tflops"], ".1f", r["error"] or "n/a")]
             for r in result["variants"]["prefill"]])
    path.mkdir(parents=True, exist_ok=True)
    target = path / "kernel.md"
    target.write_text("\n".join(lines) + "\n")
    return target


def print_table(console, title: str, header: list[str], body: list[list[str]]) -> None:
    """Print one rich table: text columns left-aligned, figures right-aligned."""
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column in ("order", "targets", "target", "contender",
                                                              "variant", "model") else "right")
    for cells in body:
        table.add_row(*cells)
    console.print(table)
