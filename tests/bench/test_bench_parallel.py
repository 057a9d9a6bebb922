"""`pagedkv bench parallel --smoke`: the one-GPU TP bound section runs end to end on CPU."""

import json

import torch

from pagedkv.bench import parallel
from pagedkv.models.loader import RANDOM_CONFIGS


def test_shard_model_is_one_rank_of_the_whole():
    name = parallel.shard_model("random:llama3-8b", 2)
    whole, shard = RANDOM_CONFIGS["llama3-8b"], RANDOM_CONFIGS[name.split(":", 1)[1]]
    assert shard["num_attention_heads"] * 2 == whole["num_attention_heads"]
    assert shard["num_key_value_heads"] * 2 == whole["num_key_value_heads"]
    assert shard["intermediate_size"] * 2 == whole["intermediate_size"]
    assert shard["vocab_size"] == (whole["vocab_size"] + 1) // 2
    assert shard["head_dim"] == whole["head_dim"] and shard["hidden_size"] == whole["hidden_size"]


def test_tp2_bound_smoke_records_its_section(tmp_path, monkeypatch):
    # --smoke swaps module globals and torch.cuda.get_device_name: put them back after the test
    for name in ("DTYPE", "MAX_MODEL_LEN", "SYSTEM_PROMPT_TOKENS", "nano_vllm_workload"):
        monkeypatch.setattr(parallel, name, getattr(parallel, name))
    monkeypatch.setattr(torch.cuda, "get_device_name", torch.cuda.get_device_name)
    assert parallel.main(["tp2-bound", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "parallel.json").read_text())["tp2_shard_bound"]
    assert result["model"] == "random:tiny-llama-tp2-shard" and result["tensor_parallel_size"] == 1
    assert result["decode_ms"]["1"] > 0 and result["nano"]["num_output_tokens"] > 0
