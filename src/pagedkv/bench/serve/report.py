"""What `bench serve` shows and keeps: a table per run on stdout, `serve.json`, and `serve.png`.

The figure has two panels: P50 and P99 of TTFT, TPOT and ITL against the request rate each
run reached (one point per `--request-rate`), and the per-request CDF of TTFT and TPOT of
every run.
"""

from __future__ import annotations

from pathlib import Path

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def format_run(run: dict) -> str:
    """One run as a plain-text table (vLLM's layout: counts, throughputs, then latency rows)."""
    s, client = run["summary"], run["client"]
    rate = run["request_rate"]
    lines = [f"{f' request rate {rate} ':=^64}",
             f"{'Successful / failed requests:':<40}{s['num_completed']:>10} / {s['num_failed']}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
             f"{'Prompt / output tokens:':<40}{s['num_prompt_tokens']:>10} / {s['num_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.1f}",
             f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.1f}"]
    if s["slo_ms"]:
        slo = ",".join(f"{k}:{v:g}" for k, v in s["slo_ms"].items())
        lines.append(f"{f'Request goodput under {slo} (req/s):':<40}{s['request_goodput']:>10.2f}")
    lines.append(f"{'(ms)':<10}{'mean':>12}{'P50':>12}{'P90':>12}{'P99':>12}")
    for key, name in LATENCIES:
        d = s[key]
        lines.append(f"{name:<10}{_ms(d['mean']):>12}{_ms(d['p50']):>12}{_ms(d['p90']):>12}{_ms(d['p99']):>12}")
    lines.append(f"client: parse {_ms(client['parse_ms_per_request']['mean'])} ms/request, dispatch lag P99 "
                 f"{_ms(client['dispatch_lag_ms']['p99'])} ms, event-loop lag P99 "
                 f"{_ms(client['event_loop_lag_ms']['p99'])} ms, max in flight {run['max_in_flight']}")
    errors = [row["error"] for row in run["requests"] if not row["ok"]]
    if errors:
        lines.append(f"first of {len(errors)} errors: {errors[0]}")
    return "\n".join(lines)


def write_png(result: dict, path: Path) -> Path | None:
    """Latency against achieved request rate, and per-request CDFs; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result["runs"]
    fig, (by_rate, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [run["summary"]["request_throughput"] for run in runs]
    for (key, name), color in zip(LATENCIES[:3], ("tab:blue", "tab:orange", "tab:green")):
        for pct, style in (("p50", "-o"), ("p99", "--s")):
            values = [run["summary"][key][pct] for run in runs]
            if any(v is not None for v in values):
                by_rate.plot(rates, [float("nan") if v is None else v for v in values], style, color=color,
                             label=f"{name} {pct}")
    by_rate.set(xlabel="achieved request rate (req/s)", ylabel="latency (ms)", yscale="log",
                title=f"{result['model']}: latency against load")
    if by_rate.get_legend_handles_labels()[0]:
        by_rate.legend(fontsize=8)
    for run in runs:
        for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            values = sorted(row[key] for row in run["requests"] if row[key] is not None)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                cdf.step(values, fractions, where="post", label=f"{name} @ rate {run['request_rate']}")
    cdf.set(xlabel="ms", ylabel="fraction of requests", xscale="log", title="per-request CDF")
    if cdf.get_legend_handles_labels()[0]:
        cdf.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
