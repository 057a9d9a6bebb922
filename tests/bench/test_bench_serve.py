"""`pagedkv bench serve`: datasets, arrivals, metrics on synthetic timings, and --smoke against a live server.

The live runs go to a tiny random llama with SmolLM2's tokenizer (token-id, text and chat
prompts all work) behind a real uvicorn server. They check that every metric is present and
consistent, never how fast anything was.
"""

import asyncio
import json
import math
import random
import statistics

import numpy as np
import pytest
from server_helpers import LiveServer, tiny_chat_model

from pagedkv import LLM
from pagedkv.bench.serve import config_from_args, parse_args
from pagedkv.bench.serve.datasets import (FIRST_RANDOM_ID, WORDS, ids_to_text, length_range,
                                          prefix_chat_requests, random_requests, sharegpt_path, sharegpt_requests)
from pagedkv.bench.serve.metrics import RequestRecord, distribution_ms, meets_slo, parse_slo, summarize
from pagedkv.bench.serve.runner import InFlight, arrival_offsets, run_benchmark, run_requests
from pagedkv.cli import main as cli_main
from pagedkv.errors import InvalidArgumentError
from pagedkv.server import create_app

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


# ---------------------------------------------------------------------- datasets

def test_random_lengths_in_range_and_seeded():
    requests = random_requests(200, input_len=64, output_len=16, range_ratio=0.25, vocab_size=1000, seed=3)
    low_in, high_in = length_range(64, 0.25)
    low_out, high_out = length_range(16, 0.25)
    assert (low_in, high_in) == (48, 80) and (low_out, high_out) == (12, 20)
    for request in requests:
        (role, ids), = request.messages
        assert role == "user" and len(ids) == request.num_prompt_tokens
        assert low_in <= len(ids) <= high_in and low_out <= request.max_tokens <= high_out
        assert all(FIRST_RANDOM_ID <= i < 1000 for i in ids)
    assert {len(r.messages[0][1]) for r in requests} >= {low_in, high_in}  # the whole range is drawn
    assert requests == random_requests(200, 64, 16, 0.25, 1000, seed=3)
    assert requests != random_requests(200, 64, 16, 0.25, 1000, seed=4)
    fixed = random_requests(5, 10, 4, 0.0, 1000, seed=0)
    assert all(r.num_prompt_tokens == 10 and r.max_tokens == 4 for r in fixed)


def test_request_bodies_ids_text_chat():
    request = random_requests(1, 12, 4, 0.0, 1000, seed=0)[0]
    ids = list(request.messages[0][1])
    assert request.body("ids") == {"prompt": ids}
    text = request.body("text")["prompt"]
    assert text == ids_to_text(tuple(ids)) and len(text.split()) == 12 and set(text.split()) <= set(WORDS)
    assert request.body("chat") == {"messages": [{"role": "user", "content": text}]}
    with pytest.raises(InvalidArgumentError, match="prompt format"):
        request.body("xml")
    with pytest.raises(InvalidArgumentError, match="range ratio"):
        random_requests(1, 12, 4, 1.0, 1000, seed=0)


def test_prefix_chat_shares_system_prompts_and_extends_turns():
    num_prefixes, num_conversations, num_turns = 3, 7, 4
    requests = prefix_chat_requests(num_prefixes, num_conversations, num_turns, prefix_len=20, input_len=8,
                                    output_len=6, range_ratio=0.5, vocab_size=500, seed=1)
    assert len(requests) == num_conversations * num_turns
    systems = {r.messages[0][1] for r in requests}
    assert len(systems) == num_prefixes and all(len(s) == 20 for s in systems)
    for index, request in enumerate(requests):
        turn, conversation = divmod(index, num_conversations)
        assert request.prefix_id == conversation % num_prefixes
        assert [role for role, _ in request.messages] == ["system"] + ["user", "assistant"] * turn + ["user"]
        assert request.num_prompt_tokens == len(request.body("ids")["prompt"])
        if turn:  # this turn's prompt extends the previous turn's prompt and reply
            previous = requests[index - num_conversations]
            assert request.messages[:len(previous.messages)] == previous.messages
            assert len(request.messages[len(previous.messages)][1]) == previous.max_tokens
    same_prefix = [r for r in requests if r.prefix_id == 0]
    assert len({r.messages[0] for r in same_prefix}) == 1
    chat = requests[-1].body("chat")["messages"]
    assert chat[0]["role"] == "system" and chat[-1]["role"] == "user"


def test_sharegpt_shipped_file_parses(tmp_path):
    path = sharegpt_path()
    assert path.is_file()
    conversations = json.loads(path.read_text())
    usable = [c for c in conversations if len(c["conversations"]) >= 2]
    assert 0 < len(usable) < len(conversations)  # one conversation has no reply and is skipped
    requests = sharegpt_requests(path, num_requests=50, seed=0)
    assert len(requests) == 50
    assert {r.messages[0][1] for r in requests} <= {c["conversations"][0]["value"] for c in usable}
    assert all(r.num_prompt_tokens >= 4 and r.max_tokens >= 4 for r in requests)
    assert all(r.body("ids") == r.body("text") for r in requests)  # text has no token ids: sent as text
    assert all(r.max_tokens == 9 for r in sharegpt_requests(path, 5, seed=0, output_len=9))
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(InvalidArgumentError, match="JSON list"):
        sharegpt_requests(bad, 1, seed=0)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        sharegpt_requests(tmp_path / "missing.json", 1, seed=0)


# ---------------------------------------------------------------------- arrivals and concurrency

@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_mean_gap_is_one_over_rate(burstiness):
    rate = 8.0
    offsets = arrival_offsets(40_000, rate, burstiness, seed=11)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma gaps: squared coefficient of variation = 1 / shape (1 for Poisson)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)
    assert offsets == arrival_offsets(40_000, rate, burstiness, seed=11)


def test_arrivals_infinite_rate_and_bad_values():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, 0.0)):
        with pytest.raises(InvalidArgumentError):
            arrival_offsets(3, rate, burstiness)


@pytest.mark.parametrize("max_concurrency", [None, 1, 5])
def test_max_concurrency_never_exceeded(max_concurrency):
    num_requests = 40
    rng = random.Random(max_concurrency or 0)
    hold_s = [rng.uniform(0.0, 0.004) for _ in range(num_requests)]
    in_flight = InFlight()
    seen_max = []

    async def send(index, run_start, dispatch_lag_s):
        seen_max.append(in_flight.num_now)
        await asyncio.sleep(hold_s[index])
        return RequestRecord(index=index, ok=True, start_s=0.0, dispatch_lag_s=dispatch_lag_s, e2e_s=hold_s[index])

    offsets = arrival_offsets(num_requests, 2000.0, seed=1)
    records, duration_s = asyncio.run(run_requests(offsets, max_concurrency, send, in_flight=in_flight))
    assert [r.index for r in records] == list(range(num_requests)) and duration_s > 0
    assert in_flight.num_now == 0 and max(seen_max) == in_flight.num_max
    if max_concurrency is None:
        assert in_flight.num_max > 1
    else:
        assert in_flight.num_max <= max_concurrency


# ---------------------------------------------------------------------- metrics on synthetic timings

def _record(index, ttft_s, e2e_s, num_output_tokens, ok=True, itl_s=()):
    return RequestRecord(index=index, ok=ok, start_s=0.0, dispatch_lag_s=0.0, e2e_s=e2e_s, ttft_s=ttft_s,
                         itl_s=itl_s, num_prompt_tokens=10, num_output_tokens=num_output_tokens, usage_reported=True)


def test_summarize_synthetic_records():
    records = [_record(0, 0.100, 0.190, 10, itl_s=(0.01,) * 9),  # TPOT 10 ms
               _record(1, 0.300, 0.700, 5, itl_s=(0.1,) * 4),    # TPOT 100 ms
               _record(2, 0.050, 0.050, 1),                      # one token: no TPOT
               _record(3, None, 2.0, 0, ok=False)]
    summary = summarize(records, duration_s=2.0, slo=parse_slo("ttft:200,tpot:50"))
    assert (summary["num_completed"], summary["num_failed"]) == (3, 1)
    assert summary["num_output_tokens"] == 16 and summary["num_prompt_tokens"] == 30
    assert summary["request_throughput"] == 1.5 and summary["output_throughput"] == 8.0
    assert summary["total_token_throughput"] == 23.0
    assert summary["num_good"] == 2 and summary["request_goodput"] == 1.0  # request 1 misses both bounds
    assert summary["tpot_ms"]["mean"] == pytest.approx(55.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["ttft_ms"]["p99"] == pytest.approx(np.percentile([100, 300, 50], 99))
    assert summary["e2e_ms"]["p90"] == pytest.approx(np.percentile([190, 700, 50], 90))
    assert summary["itl_ms"]["mean"] == pytest.approx((9 * 10 + 4 * 100) / 13)
    assert records[0].tpot_s * 9 + records[0].ttft_s == pytest.approx(records[0].e2e_s)
    assert records[2].tpot_s is None and meets_slo(records[2], {"tpot": 1.0})
    assert not meets_slo(records[3], {})
    assert summarize(records, 2.0)["num_good"] == 3  # no SLO: every finished request is good
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_parse_slo():
    assert parse_slo("ttft:200,tpot:50,e2el:1000") == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft", "ttft:-1", "itl:5", "tpot:abc", "ttft:inf"):
        with pytest.raises(InvalidArgumentError, match="SLO"):
            parse_slo(bad)


# ---------------------------------------------------------------------- --smoke against a live server

@pytest.fixture(scope="module")
def server():
    model, tokenizer = tiny_chat_model()
    llm = LLM(hf_model=model, tokenizer=tokenizer, block_size=4, num_blocks=512)
    with LiveServer(create_app(llm.engine, "tiny-bench")) as live:
        yield live


def _check_run(run, requests, max_concurrency):
    summary = run["summary"]
    assert summary["num_failed"] == 0 and summary["num_completed"] == len(requests)
    assert summary["usage_reported_fraction"] == 1.0
    for key in LATENCY_KEYS:
        dist = summary[key]
        assert None not in dist.values(), key
        assert 0 <= dist["p50"] <= dist["p90"] <= dist["p99"], key
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]
    assert summary["request_goodput"] <= summary["request_throughput"]
    assert summary["output_throughput"] <= summary["total_token_throughput"]
    assert run["max_in_flight"] <= max_concurrency
    assert run["client"]["parse_ms_per_request"]["mean"] is not None
    assert run["client"]["event_loop_lag_ms"]["p99"] is not None
    for row, request in zip(run["requests"], requests):
        assert row["ok"] and row["e2e_ms"] >= row["ttft_ms"] > 0
        assert row["num_output_tokens"] == request.max_tokens  # ignore_eos
        if row["num_output_tokens"] > 1:  # rows are rounded to 1 us
            rebuilt = row["tpot_ms"] * (row["num_output_tokens"] - 1) + row["ttft_ms"]
            assert rebuilt == pytest.approx(row["e2e_ms"], abs=0.002 + 0.0005 * row["num_output_tokens"])


def test_smoke_function_call(server):
    config = config_from_args(parse_args(["--smoke", "--base-url", server.url, "--disable-tqdm"]))
    assert config.ignore_eos and config.max_concurrency == 4 and len(config.request_rates) == 2
    result = asyncio.run(run_benchmark(config))
    assert result["model"] == "tiny-bench" and result["prompt_format"] == "ids" and result["return_token_ids"]
    assert [run["request_rate"] for run in result["runs"]] == [50.0, "inf"]
    for run in result["runs"]:
        _check_run(run, config.requests(), config.max_concurrency)
        assert {row["num_prompt_tokens"] for row in run["requests"]} == {r.num_prompt_tokens
                                                                        for r in config.requests()}
    server.wait_idle()


def test_smoke_cli_chat_prefix_chat(server, tmp_path, capsys):
    argv = ["bench", "serve", "--smoke", "--base-url", server.url, "--out", str(tmp_path), "--disable-tqdm",
            "--endpoint", "chat", "--dataset", "prefix-chat", "--num-prefixes", "2", "--num-conversations", "3",
            "--turns", "2", "--prefix-len", "24"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "goodput" in out and "event-loop lag" in out
    payload = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert payload["benchmark"] == "serve" and payload["prompt_format"] == "chat"
    assert payload["provenance"]["commit"] and payload["config"]["api_key"] is False
    config = config_from_args(parse_args(argv[2:]))
    for run in payload["runs"]:
        _check_run(run, config.requests(), 4)
    server.wait_idle()


def test_text_prompts_and_unreachable_server(server, tmp_path, capsys):
    config = config_from_args(parse_args(["--smoke", "--base-url", server.url, "--disable-tqdm", "--dataset",
                                          "sharegpt", "--prompt-format", "text", "--request-rate", "inf"]))
    run, = asyncio.run(run_benchmark(config))["runs"]
    assert run["summary"]["num_failed"] == 0
    assert statistics.mean(r["num_prompt_tokens"] for r in run["requests"]) > 4  # from usage, not estimated
    whole = config_from_args(parse_args(["--smoke", "--base-url", server.url, "--disable-tqdm", "--no-stream",
                                         "--request-rate", "inf"]))
    result = asyncio.run(run_benchmark(whole))
    assert not result["return_token_ids"]
    summary = result["runs"][0]["summary"]
    assert summary["num_failed"] == 0 and summary["e2e_ms"]["p50"] > 0 and summary["ttft_ms"]["p50"] is None
    assert summary["num_output_tokens"] == sum(r.max_tokens for r in whole.requests())
    assert cli_main(["bench", "serve", "--smoke", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "is the server up" in capsys.readouterr().err
