"""`bench serve --dataset ids`: an exact token-id request list replayed from a file, in order, never cycled.

The live run sends the file to a tiny random llama behind a real uvicorn server and checks that
every request arrived with its exact prompt length and output length.
"""

import asyncio
import json

import pytest
from server_helpers import LiveServer, tiny_chat_model

from pagedkv import LLM
from pagedkv.bench.serve import config_from_args, parse_args
from pagedkv.bench.serve.datasets import token_id_requests
from pagedkv.bench.serve.runner import run_benchmark
from pagedkv.errors import InvalidArgumentError
from pagedkv.server import create_app

ROWS = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 4},
        {"prompt_token_ids": list(range(200, 211)), "max_tokens": 2},
        {"prompt_token_ids": [300] * 6, "max_tokens": 3}]


def _write(tmp_path, rows, name="requests.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def test_token_ids_replayed_in_order(tmp_path):
    path = _write(tmp_path, ROWS)
    requests = token_id_requests(path, 3)
    assert [r.body("ids")["prompt"] for r in requests] == [row["prompt_token_ids"] for row in ROWS]
    assert [r.max_tokens for r in requests] == [4, 2, 3]
    assert [r.num_prompt_tokens for r in requests] == [3, 11, 6]
    assert all(r.is_token_ids for r in requests)
    assert token_id_requests(path, 2) == requests[:2]


def test_token_ids_errors_name_the_problem(tmp_path):
    path = _write(tmp_path, ROWS)
    with pytest.raises(InvalidArgumentError, match="holds 3 requests, 4 asked for"):
        token_id_requests(path, 4)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        token_id_requests(tmp_path / "missing.json", 1)
    with pytest.raises(InvalidArgumentError, match="JSON list"):
        token_id_requests(_write(tmp_path, {"prompt_token_ids": [1]}, "dict.json"), 1)
    for bad in ({"prompt_token_ids": [], "max_tokens": 1}, {"prompt_token_ids": [1, -2], "max_tokens": 1},
                {"prompt_token_ids": ["a"], "max_tokens": 1}, {"prompt_token_ids": [1]}, [1, 2]):
        with pytest.raises(InvalidArgumentError, match="request 1"):
            token_id_requests(_write(tmp_path, [ROWS[0], bad], "bad.json"), 2)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be >= 1"):
        token_id_requests(_write(tmp_path, [{"prompt_token_ids": [1], "max_tokens": 0}], "zero.json"), 1)


def test_config_needs_a_path(tmp_path):
    with pytest.raises(InvalidArgumentError, match="--dataset-path"):
        config_from_args(parse_args(["--dataset", "ids"]))
    config = config_from_args(parse_args(["--dataset", "ids", "--dataset-path", str(_write(tmp_path, ROWS)),
                                          "--num-prompts", "3"]))
    assert [r.max_tokens for r in config.requests()] == [4, 2, 3]


def test_live_replay_sends_exact_lengths(tmp_path):
    model, tokenizer = tiny_chat_model()
    llm = LLM(hf_model=model, tokenizer=tokenizer, block_size=4, num_blocks=256)
    path = _write(tmp_path, ROWS)
    with LiveServer(create_app(llm.engine, "tiny-ids")) as live:
        config = config_from_args(parse_args(["--base-url", live.url, "--dataset", "ids", "--dataset-path",
                                              str(path), "--num-prompts", "3", "--ignore-eos", "--disable-tqdm"]))
        run, = asyncio.run(run_benchmark(config))["runs"]
    assert run["summary"]["num_failed"] == 0
    rows = sorted(run["requests"], key=lambda row: row["index"])
    assert [row["num_prompt_tokens"] for row in rows] == [3, 11, 6]
    assert [row["num_output_tokens"] for row in rows] == [4, 2, 3]
