"""The KV-cache calculator: PageFault's numbers, presets, HF config parsing, CLI output and errors.

Expected values are worked out by hand in each test (the arithmetic is in the test), never
copied from the code's output.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.calc import (
    PRESETS,
    budget_capacity,
    custom_sizing,
    load_hf_config,
    preset_sizing,
    spec_from_config_file,
    spec_from_hf_config,
)
from pagedkv.cli import main
from pagedkv.core import generate_lengths
from pagedkv.errors import ConfigError, InvalidArgumentError

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
SRC = Path(__file__).parents[2] / "src"
GB = 10**9


def run_json(*args: str, capsys) -> dict:
    assert main(["calc", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------- PageFault's example
def test_pagefault_llama3_70b_budget():
    sizing = preset_sizing("llama3-70b")
    # 2 (K and V) * 80 layers * 8 KV heads * head_dim 8192 / 64 = 128 * 2 bytes (bf16)
    assert sizing.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680 == 320 * 1024
    capacity = budget_capacity(sizing, budget_bytes=80 * GB, max_len=8192, mean_len=2000, block_size=16)
    # naive: 8,192 * 327,680 = 2,684,354,560 B per sequence; 80e9 / 2,684,354,560 = 29.8 -> 29
    assert capacity.naive_bytes_per_seq == 8192 * 327_680 == 2_684_354_560
    assert capacity.num_naive_seqs == 29
    # paged: ceil(2000 / 16) = 125 blocks = 2,000 tokens; 2,000 * 327,680 = 655,360,000 B; 80e9 / that = 122.07
    assert capacity.num_blocks_per_seq == 125
    assert capacity.paged_bytes_per_seq == 2000 * 327_680 == 655_360_000
    assert capacity.num_paged_seqs == 122
    assert capacity.gain == pytest.approx(122 / 29) and f"{capacity.gain:.1f}" == "4.2"


def test_paged_estimate_rounds_up_to_whole_blocks():
    sizing = preset_sizing("llama3-70b")
    capacity = budget_capacity(sizing, 80 * GB, max_len=8192, mean_len=2001, block_size=16)
    # ceil(2001 / 16) = 126 blocks = 2,016 tokens; 80e9 / (2,016 * 327,680 = 660,602,880) = 121.1
    assert capacity.paged_tokens_per_seq == 2016
    assert capacity.num_paged_seqs == 121


def test_pagefault_numbers_through_the_cli(capsys):
    result = run_json("--model", "llama3-70b", "--budget-gb", "80", "--max-len", "8192", "--mean-len", "2000",
                      capsys=capsys)
    assert result["model"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    budget = result["budget"]
    assert (budget["num_naive_seqs"], budget["num_paged_seqs"]) == (29, 122)
    assert budget["budget_bytes"] == 80 * GB
    assert [f["name"] for f in result["formulas"]][:1] == ["bytes/token"]

    assert main(["calc", "--model", "llama3-70b", "--budget-gb", "80", "--max-len", "8192",
                 "--mean-len", "2000"]) == 0
    out = capsys.readouterr().out
    assert "Core formulas" in out and "2 * 80 * 8 * 128 * 2 = 327,680 B" in out
    assert "122 / 29 = 4.2x" in out and "327,680 B (320 KiB)" in out


def test_fp8_kv_doubles_pagefaults_capacity_beside_the_model_dtype(capsys):
    args = ("--model", "llama3-70b", "--budget-gb", "80", "--max-len", "8192", "--mean-len", "2000")
    result = run_json(*args, "--kv-dtype", "fp8", capsys=capsys)
    assert result["model"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 1
    assert result["model_dtype"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert (result["model_dtype_budget"]["num_naive_seqs"], result["model_dtype_budget"]["num_paged_seqs"]) == (29, 122)
    assert (result["budget"]["num_naive_seqs"], result["budget"]["num_paged_seqs"]) == (59, 244)
    assert run_json(*args, "--kv-dtype", "bf16", capsys=capsys)["model_dtype"] is None  # the model's own: no pair
    assert main(["calc", *args, "--kv-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "paged fp8" in out and "paged 16-bit" in out and "2.00x" in out and "244" in out and "122" in out


# ---------------------------------------------------------------------- presets
#: preset -> published config.json numbers: 2 * layers * kv_heads * head_dim * dtype_bytes
PRESET_BYTES_PER_TOKEN = {
    "llama2-7b": 2 * 32 * 32 * (4096 // 32) * 2,  # fp16, MHA
    "llama3-8b": 2 * 32 * 8 * (4096 // 32) * 2,  # bf16, GQA 32/8
    "llama3-70b": 2 * 80 * 8 * (8192 // 64) * 2,
    "qwen3-0.6b": 2 * 28 * 8 * 128 * 2,  # head_dim 128 is explicit (hidden 1024 / 16 heads would be 64)
    "gpt2": 2 * 12 * 12 * (768 // 12) * 2,  # no dtype in config: served in fp16
    "smollm2-135m": 2 * 30 * 3 * (576 // 9) * 2,
    "llama3.2-1b": 2 * 16 * 8 * 64 * 2,
    "mistral-7b": 2 * 32 * 8 * (4096 // 32) * 2,  # every layer slides (window 4,096)
    "gemma3-1b": 2 * 26 * 1 * 256 * 2,
    "gemma3-4b": 2 * 34 * 4 * 256 * 2,
    "gemma3-12b": 2 * 48 * 8 * 256 * 2,
    "gemma3-27b": 2 * 62 * 16 * 128 * 2,
    "gemma2-2b": 2 * 26 * 4 * 256 * 2,
    "gemma2-9b": 2 * 42 * 8 * 256 * 2,
    "gemma2-27b": 2 * 46 * 16 * 128 * 2,
    "phi3-mini": 2 * 32 * 32 * (3072 // 32) * 2,  # MHA; every layer slides (window 2,047)
    "phi3.5-mini": 2 * 32 * 32 * (3072 // 32) * 2,
}
#: preset -> (full layers, sliding layers, window): Gemma 3 every 6th layer global, Gemma 2 every 2nd.
PRESET_WINDOWS = {
    "mistral-7b": (0, 32, 4096), "gemma3-1b": (4, 22, 512), "gemma3-4b": (5, 29, 1024),
    "gemma3-12b": (8, 40, 1024), "gemma3-27b": (10, 52, 1024), "gemma2-2b": (13, 13, 4096),
    "gemma2-9b": (21, 21, 4096), "gemma2-27b": (23, 23, 4096), "phi3-mini": (0, 32, 2047),
    "phi3.5-mini": (0, 32, 262144),
}


@pytest.mark.parametrize("name", sorted(PRESET_WINDOWS))
def test_preset_sliding_layers(name):
    sizing = preset_sizing(name)
    assert (sizing.num_full_layers, sizing.num_sliding_layers, sizing.sliding_window_tokens) == PRESET_WINDOWS[name]


@pytest.mark.parametrize("name", sorted(PRESET_BYTES_PER_TOKEN))
def test_preset_bytes_per_token(name):
    sizing = preset_sizing(name)
    assert sizing.bytes_per_token == PRESET_BYTES_PER_TOKEN[name]
    assert sizing.to_model_spec().bytes_per_token == PRESET_BYTES_PER_TOKEN[name]


def test_every_preset_is_tested():
    assert set(PRESETS) == set(PRESET_BYTES_PER_TOKEN)


def test_dtype_bytes_override_and_custom(capsys):
    assert preset_sizing("llama3-8b", dtype_bytes=1).bytes_per_token == 2 * 32 * 8 * 128 * 1  # fp8 KV
    result = run_json("--model", "custom", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                      "--dtype-bytes", "2", capsys=capsys)
    assert result["model"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert custom_sizing(32, 8, 128).bytes_per_token == 2 * 32 * 8 * 128 * 2


# ---------------------------------------------------------------------- HF config parsing
def test_gpt2_names():
    sizing = spec_from_config_file(CONFIGS / "gpt2.json")
    # n_layer 12, n_head 12 (no KV-head field: MHA), head_dim n_embd 768 / 12 = 64, n_positions 1024
    assert (sizing.num_layers, sizing.num_kv_heads, sizing.head_dim) == (12, 12, 64)
    assert sizing.max_position_embeddings == 1024
    assert sizing.dtype_bytes == 2 and any("no dtype" in note for note in sizing.notes)


def test_missing_kv_heads_means_mha():
    sizing = spec_from_config_file(CONFIGS / "llama1_7b_no_kv_heads.json")
    assert sizing.num_kv_heads == 32
    assert sizing.bytes_per_token == 2 * 32 * 32 * (4096 // 32) * 2  # float16
    assert any("MHA" in note for note in sizing.notes)


def test_head_dim_null_falls_back_to_hidden_over_heads():
    sizing = spec_from_config_file(CONFIGS / "tinyllama_head_dim_null.json")
    assert sizing.head_dim == 2048 // 32 == 64
    assert sizing.bytes_per_token == 2 * 22 * 4 * 64 * 2  # `dtype` bfloat16
    assert any("head_dim not set" in note for note in sizing.notes)


def test_text_config_nesting_with_gemma_alternation():
    sizing = spec_from_config_file(CONFIGS / "gemma3_4b_multimodal.json")
    # text_config: 34 layers, 4 KV heads, head_dim 256; torch_dtype bfloat16 from the outer config
    assert sizing.bytes_per_token == 34 * 2 * 4 * 256 * 2
    # every 6th layer (indices 5, 11, 17, 23, 29) is full; the other 29 slide over 1,024 tokens
    assert (sizing.num_full_layers, sizing.num_sliding_layers, sizing.sliding_window_tokens) == (5, 29, 1024)
    assert any("text_config" in note for note in sizing.notes)
    per_layer = 2 * 4 * 256 * 2
    assert sizing.seq_kv_bytes(8192) == (5 * 8192 + 29 * 1024) * per_layer


def test_mla_caches_one_latent():
    sizing = spec_from_config_file(CONFIGS / "deepseek_v2_lite_mla.json")
    assert sizing.is_mla
    # 27 layers * (kv_lora_rank 512 + qk_rope_head_dim 64) * 2 bytes; no factor 2 for K and V
    assert sizing.bytes_per_token == 27 * (512 + 64) * 2 == 31_104
    note = next(note for note in sizing.notes if note.startswith("MLA"))
    assert "576" in note and "16 * (128 + 64 + 128) = 5,120" in note
    with pytest.raises(ConfigError, match="MLA"):
        sizing.to_model_spec()
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        spec_from_hf_config({"num_hidden_layers": 2, "kv_lora_rank": 512})


def test_sliding_window_layer_types():
    sizing = spec_from_config_file(CONFIGS / "gpt_oss_20b_sliding.json")
    per_layer = 2 * 8 * 64 * 2
    assert sizing.bytes_per_token == 24 * per_layer  # a token inside every window
    assert (sizing.num_sliding_layers, sizing.sliding_window_tokens) == (12, 128)
    # contiguous: 12 full layers hold 8,192 tokens, 12 sliding layers a 128-token ring
    assert sizing.seq_kv_bytes(8192) == (12 * 8192 + 12 * 128) * per_layer
    # paged: full layers ceil(2000 / 16) = 125 blocks; a 128-token window spans up to ceil(127 / 16) + 1 = 9
    assert sizing.window_blocks(16) == 9
    assert sizing.paged_seq_kv_bytes(2000, 16) == (12 * 125 + 12 * 9) * 16 * per_layer
    assert sizing.paged_seq_kv_bytes(100, 16) == (12 * 7 + 12 * 7) * 16 * per_layer  # below the window: uncapped
    assert any("12 of 24 layers" in note for note in sizing.notes)


def test_sliding_window_other_spellings():
    base = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584}
    # Qwen2: layers from max_window_layers on slide, only when use_sliding_window is true
    qwen = spec_from_hf_config({**base, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 20})
    assert qwen.num_sliding_layers == 28 - 20
    off = spec_from_hf_config({**base, "sliding_window": 131072, "use_sliding_window": False})
    assert off.num_sliding_layers == 0 and off.sliding_window_tokens is None
    # Mistral v0.1: a bare sliding_window applies to every layer
    assert spec_from_hf_config({**base, "sliding_window": 4096}).num_sliding_layers == 28
    # Gemma 2 without layer_types: even-indexed layers slide
    assert spec_from_hf_config({**base, "model_type": "gemma2", "sliding_window": 4096}).num_sliding_layers == 14
    with pytest.raises(ConfigError, match="layer_types"):
        spec_from_hf_config({**base, "sliding_window": 4096, "layer_types": ["sliding_attention"] * 3})


def test_sliding_window_budget_through_the_cli(capsys):
    result = run_json("--config", str(CONFIGS / "gpt_oss_20b_sliding.json"), "--budget-gb", "10",
                      "--max-len", "8192", "--mean-len", "2000", capsys=capsys)
    per_layer = 2 * 8 * 64 * 2
    naive = (12 * 8192 + 12 * 128) * per_layer
    paged = (12 * 125 + 12 * 9) * 16 * per_layer
    assert result["budget"]["num_naive_seqs"] == 10 * GB // naive
    assert result["budget"]["num_paged_seqs"] == 10 * GB // paged
    assert any("sliding window" in note for note in result["notes"])


def test_config_dtype():
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert spec_from_hf_config({**base, "torch_dtype": "float32"}).dtype_bytes == 4
    assert spec_from_hf_config({**base, "dtype": "bfloat16", "torch_dtype": "float32"}).dtype_bytes == 2
    assert spec_from_hf_config({**base, "torch_dtype": "float32"}, dtype_bytes=2).dtype_bytes == 2
    with pytest.raises(ConfigError, match="torch_dtype"):
        spec_from_hf_config({**base, "torch_dtype": "complex64"})


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        spec_from_config_file(CONFIGS / "bad_missing_layers.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(CONFIGS / "bad_not_json.json")
    with pytest.raises(ConfigError, match="num_attention_heads"):
        spec_from_hf_config({"num_hidden_layers": 2, "hidden_size": 256})
    with pytest.raises(ConfigError, match="text_config.num_hidden_layers must be a positive int"):
        spec_from_hf_config({"text_config": {"num_hidden_layers": 0}})
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 8}))
    assert spec_from_config_file(folder).head_dim == 8 // 2  # a model folder works too


# ---------------------------------------------------------------------- workload and --json
def test_workload_default_json(capsys):
    result = run_json(capsys=capsys)
    workload = result["workload"]
    lengths = generate_lengths(32, seed=42)
    assert workload["lengths"] == lengths
    assert workload["naive_reserved_bytes"] == 32 * 2048 * 512  # 33.55 MB, as PageFault
    assert workload["paged_reserved_bytes"] == sum(math.ceil(n / 16) for n in lengths) * 16 * 512
    assert [row["block_size"] for row in workload["sweep"]] == [1, 16, 64, 256]
    assert [row["table_entries_per_seq"] for row in workload["sweep"]] == [2048, 128, 32, 8]
    assert result["model"] is None and result["budget"] is None
    assert any(f["name"] == "naive capacity" and f["value"].startswith("65,536 / 2,048 = 32")
               for f in result["formulas"])


def test_workload_text_and_options(capsys):
    assert main(["calc", "--seqs", "8", "--seed", "7", "--block-size", "32", "--max-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "Block-size sweep" in out and "Core formulas" in out and "utilization" in out
    assert "8 / 7" in out and "4,096 tokens" in out


# ---------------------------------------------------------------------- bad input: one line, exit 2
BAD_INPUTS = [
    (["--model", "llama9"], "unknown model preset 'llama9'"),
    (["--config", "no/such/config.json"], "no such file"),
    (["--config", str(CONFIGS / "bad_not_json.json")], "not valid JSON"),
    (["--config", str(CONFIGS / "bad_missing_layers.json")], "missing num_hidden_layers"),
    (["--block-size", "0"], "--block-size"),
    (["--seqs", "-1"], "--seqs"),
    (["--seqs", "many"], "--seqs"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--max-len", "100"], "--max-len"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--model", "gpt2", "--config", "x.json"], "--config"),
    (["--model", "gpt2", "--seqs", "4"], "--seqs"),
    (["--layers", "4"], "--layers"),
    (["--model", "custom", "--layers", "32"], "--kv-heads"),
    (["--model", "custom", "--layers", "0", "--kv-heads", "8", "--head-dim", "128"], "--layers"),
    (["--model", "gpt2", "--dtype-bytes", "0"], "--dtype-bytes"),
    (["--model", "gpt2", "--kv-dtype", "int4"], "--kv-dtype"),
    (["--model", "gpt2", "--kv-dtype", "fp8", "--dtype-bytes", "1"], "--dtype-bytes"),
    (["--kv-dtype", "fp8"], "--kv-dtype"),
    (["--budget-gb", "80", "--mean-len", "100"], "--budget-gb"),
    (["--model", "gpt2", "--budget-gb", "0", "--mean-len", "100"], "--budget-gb"),
    (["--model", "gpt2", "--budget-gb", "nan", "--mean-len", "100"], "--budget-gb"),
    (["--model", "gpt2", "--budget-gb", "80", "--mean-len", "0"], "--mean-len"),
    (["--model", "gpt2", "--budget-gb", "80", "--mean-len", "2000"], "--mean-len"),  # over n_positions 1024
    (["--model", "gpt2", "--mean-len", "100"], "--mean-len"),
    (["--model", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "2", "--budget-gb", "1",
      "--mean-len", "10"], "--max-len"),
]


@pytest.mark.parametrize("args,field", BAD_INPUTS, ids=[" ".join(args)[:50] for args, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(args, field, capsys):
    assert main(["calc", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pagedkv: error: ") and captured.err.count("\n") == 1
    assert field in captured.err


@pytest.mark.parametrize("config,field", [
    ([1, 2], "expected a JSON object, got list"),
    ({"num_hidden_layers": 0, "num_attention_heads": 2, "hidden_size": 8}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": -4}, "head_dim"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "torch_dtype": "int4"}, "torch_dtype"),
])
def test_bad_config_file_is_one_line_exit_2(config, field, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["calc", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err and str(path) in err


def test_bad_input_in_a_real_process():
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "calc", "--model", "llama9"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.rstrip("\n")]
    assert proc.stderr.startswith("pagedkv: error: unknown model preset 'llama9'")
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr


def test_calc_imports_neither_torch_nor_transformers():
    code = ("import sys; import pagedkv.calc; assert 'rich' not in sys.modules, 'import has side effects'; "
            "from pagedkv.cli import main; assert main(['calc', '--json']) == 0; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'calc imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)


def test_invalid_api_arguments():
    sizing = preset_sizing("llama3-8b")
    with pytest.raises(InvalidArgumentError, match="mean_len"):
        budget_capacity(sizing, GB, max_len=100, mean_len=200)
    with pytest.raises(InvalidArgumentError, match="budget_bytes"):
        budget_capacity(sizing, 0, max_len=100, mean_len=50)


def test_layer_groups_of_gemma3_match_a_hand_count_of_bytes():
    """Per-group sizing at 32K tokens against the bytes counted by hand from the published config."""
    from pagedkv.calc.cli import build_parser, compute

    result = compute(build_parser().parse_args(["--model", "gemma3-12b", "--max-len", "32768", "--budget-gb", "80"]))
    groups = result["groups"]
    per_layer = 2 * 8 * 256 * 2  # K and V, 8 KV heads of 256, bf16: 8,192 B per token per layer
    # 48 layers, every 6th global: 8 full, 40 sliding (window 1,024) -> 1 full group and 5 sliding groups of 8.
    assert [(g["type"], g["num_layers"], g["num_slots"]) for g in groups["groups"]] == \
        [("full_attention", 8, 8)] + [("sliding_attention", 8, 8)] * 5
    full_blocks, window_blocks = 32768 // 16, 1023 // 16 + 1 + 1  # ceil(1023 / 16) + 1 = 65
    grouped = (8 * full_blocks + 40 * window_blocks) * 16 * per_layer
    full_length = 48 * full_blocks * 16 * per_layer
    assert groups["bytes_per_seq"] == {"naive_full_length": 32768 * 48 * per_layer,
                                       "paged_full_length": full_length, "paged_per_group": grouped}
    assert grouped == 2_488_270_848 and full_length == 12_884_901_888
    assert groups["num_seqs"] == {"naive_full_length": 80 * 10**9 // full_length,
                                  "paged_full_length": 80 * 10**9 // full_length,
                                  "paged_per_group": 80 * 10**9 // grouped}
    assert groups["gain_over_paged_full_length"] > 5


def test_layer_groups_count_padding_slots():
    """Gemma 3 27B: 10 full and 52 sliding layers; blocks of 10 layers leave 8 padding slots in one group."""
    from pagedkv.calc.groups import groups_section

    section = groups_section(preset_sizing("gemma3-27b"), 32768, 16)
    per_layer = 2 * 16 * 128 * 2
    assert [g["num_layers"] for g in section["groups"]] == [10, 10, 10, 10, 10, 10, 2]
    assert section["bytes_per_seq"]["paged_per_group"] == (2048 + 6 * 65) * 16 * 10 * per_layer
    assert preset_sizing("mistral-7b").kv_layout().num_groups == 1  # every layer slides: one sliding group


def test_kv_tiers_of_a_layer_group_model_restore_full_groups_and_windows(capsys):
    """Gemma-3-12B: a cached token keeps a page in each of its 6 groups; a restore copies the full group's blocks
    and each sliding group's window only."""
    assert main(["calc", "--model", "gemma3-12b", "--kv-offload-memory", "64GiB", "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["kv_tiers"]
    page = 16 * 8 * 2 * 8 * 256 * 2  # 16 tokens x 8 layers a group x K and V x 8 KV heads x head_dim 256 x bf16
    assert tiers["host_tokens"] == 64 * 2**30 // (6 * page) * 16
    last = tiers["prompts"][-1]
    assert last["prompt_tokens"] == 32_000
    # 2,000 blocks of the full group; of each of 5 sliding groups the blocks from (32,000 - 1,024 + 1) // 16 on
    assert last["kv_bytes"] == (2_000 + 5 * (2_000 - 1_936)) * page
    assert last["restore_s"] == pytest.approx(last["kv_bytes"] / tiers["h2d_bytes_per_s"])
