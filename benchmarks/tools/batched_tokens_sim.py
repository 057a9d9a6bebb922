"""`--max-num-batched-tokens` against TTFT and TPOT, estimated on CPU with the simulator (`pagedkv sim --cluster`).

    PYTHONPATH=src python3 benchmarks/tools/batched_tokens_sim.py --out DIR [--budgets 512,1024,2048,4096,8192]
        [--rates 10,20] [--requests 300]

One replica with the engine's own scheduler on a simulated clock, priced by the packaged H200 cost model
(Qwen3-0.6B shape: a step costs a fixed part plus a per-prefill-token part), random 1,024 in / 256 out with
Poisson arrivals. Per budget and rate it reports TTFT P50/P99 and TPOT P50 = (E2E P50 - TTFT P50) / 255,
and the longest step the budget allows (fixed part + budget x per-token part: the ITL tail a decode sees
when it shares a step with a full prefill chunk). The GPU measurement is batched_tokens_sweep.sh.
Writes DIR/batched_tokens_sim.json and .md. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUTPUT_TOKENS = 256


def run_one(out: Path, budget: int, rate: float, num_requests: int) -> dict:
    """One `pagedkv sim --cluster` run; its round-robin row (one replica: every policy is the same)."""
    where = out / f"b{budget}_r{rate:g}"
    command = [sys.executable, "-m", "pagedkv", "sim", "--cluster", "--replicas", "1", "--policy", "round_robin",
               "--rate", str(rate), "--requests", str(num_requests), "--system-prompts", "1",
               "--system-prompt-len", "16", "--user-tokens", "1008,1008",
               "--output-tokens", f"{OUTPUT_TOKENS},{OUTPUT_TOKENS}", "--replica-batched-tokens", str(budget),
               "--max-model-len", "4096", "--no-sizing", "--out", str(where)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads((where / "cluster.json").read_text())
    row = result["comparison"][0]
    cost = result["cost_model"]
    return {"budget": budget, "rate": rate, "ttft_p50_ms": 1000 * row["ttft_p50_s"], "ttft_p99_ms": 1000 * row["ttft_p99_s"],
            "tpot_p50_ms": 1000 * (row["e2e_p50_s"] - row["ttft_p50_s"]) / (OUTPUT_TOKENS - 1),
            "longest_step_ms": 1000 * (cost["c0_s"] + budget * cost["prefill_s_per_token"]),
            "throughput_tokens_per_s": row["throughput_tokens_per_s"], "cost_model": cost,
            "cost_model_source": result["cost_model_source"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", default="512,1024,2048,4096,8192")
    parser.add_argument("--rates", default="10,20")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_one(out, int(b), float(r), args.requests)
            for r in args.rates.split(",") for b in args.budgets.split(",")]
    lines = [f"# --max-num-batched-tokens on the simulator ({rows[0]['cost_model_source']}; random 1,024 in / "
             f"{OUTPUT_TOKENS} out, Poisson)", "",
             "| rate req/s | budget | TTFT P50 / P99 ms | TPOT P50 ms | longest step ms | output tok/s |",
             "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['rate']:g} | {row['budget']} | {row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | "
                     f"{row['tpot_p50_ms']:.1f} | {row['longest_step_ms']:.1f} | {row['throughput_tokens_per_s']:,.0f} |")
    (out / "batched_tokens_sim.json").write_text(json.dumps(rows, indent=1))
    (out / "batched_tokens_sim.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
