"""What one `bench serve` run measured: per-request records in, percentiles, throughput and goodput out.

`summarize` is a pure function of the records and the run's duration, so it is tested on
synthetic timings. Per request, with n output tokens:

```
send ──── TTFT ────► first token ── ITL ─► ... ── ITL ─► last token (E2E)
TPOT = (E2E - TTFT) / (n - 1)         (undefined for n = 1; such a request meets any TPOT SLO)
```
ITL is the gap between consecutive streamed chunks, so a chunk carrying several tokens is one
ITL; TPOT averages over tokens. A request meets the SLO (goodput) when every bound set in
`--slo` holds (ttft, tpot, e2el, in ms).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pagedkv.errors import InvalidArgumentError

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times in seconds; `start_s` from the run's start."""

    index: int
    ok: bool
    start_s: float  # when the request was sent
    dispatch_lag_s: float  # sent this late against its arrival time (0 when waiting for a concurrency slot)
    e2e_s: float = 0.0
    ttft_s: float | None = None  # None when no token came back (failures, non-streamed)
    itl_s: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    usage_reported: bool = False  # token counts from the server's usage, not counted chunks
    client_parse_s: float = 0.0  # time the client spent parsing this request's chunks
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None below two tokens or without a first-token time."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft:200,tpot:50` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds); None or '' -> {}."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        name, _, value = part.partition(":")
        name = name.strip().lower()
        try:
            bound_ms = float(value)
        except ValueError:
            bound_ms = -1.0
        if name not in SLO_METRICS or not (math.isfinite(bound_ms) and bound_ms > 0):
            raise InvalidArgumentError(f"SLO entries are NAME:MS with NAME in {', '.join(SLO_METRICS)} and MS > 0, "
                                       f"got {part!r}")
        slo[name] = bound_ms
    return slo


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and P50/P90/P99 in milliseconds (linear interpolation, as numpy and vLLM); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(values_ms.mean()),
            **{f"p{p}": float(np.percentile(values_ms, p)) for p in PERCENTILES}}


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a finished request kept every bound in `slo` (ms)."""
    if not record.ok:
        return False
    measured_s = {"ttft": record.ttft_s if record.ttft_s is not None else record.e2e_s,
                  "tpot": record.tpot_s, "e2el": record.e2e_s}
    return all(measured_s[name] is None or measured_s[name] * 1000.0 <= bound_ms for name, bound_ms in slo.items())


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """The run's metrics: counts, throughputs, goodput and latency distributions (ms), from its records."""
    if duration_s <= 0:
        raise InvalidArgumentError(f"duration must be > 0 s, got {duration_s}")
    slo = slo or {}
    done = [r for r in records if r.ok]
    num_output_tokens = sum(r.num_output_tokens for r in done)
    num_prompt_tokens = sum(r.num_prompt_tokens for r in done)
    num_good = sum(meets_slo(r, slo) for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": num_output_tokens / duration_s,
        "total_token_throughput": (num_prompt_tokens + num_output_tokens) / duration_s,
        "slo_ms": slo,
        "num_good": num_good,
        "request_goodput": num_good / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "usage_reported_fraction": sum(r.usage_reported for r in done) / len(done) if done else 0.0,
    }


def client_overhead(records: list[RequestRecord], loop_lags_s: list[float]) -> dict:
    """The client's own cost: chunk parsing per request, lateness of sends, and event-loop lag (ms).

    Large dispatch or loop lag means the client, not the server, set the pace of the run.
    """
    return {
        "parse_ms_per_request": distribution_ms([r.client_parse_s for r in records]),
        "dispatch_lag_ms": distribution_ms([r.dispatch_lag_s for r in records]),
        "event_loop_lag_ms": distribution_ms(loop_lags_s),
        "event_loop_lag_max_ms": max(loop_lags_s) * 1000.0 if loop_lags_s else None,
    }
