"""KV tiers in the simulator and the calculator: a host tier cuts a multi-turn chat's prefill and TTFT, the
packaged bandwidths say whether they were measured, and `calc` sizes the tiers."""

import json

import pytest

from pagedkv.cli import main
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.sim.chat_tiers import Conversations, MultiTurnChat, simulate_chat, tier_blocks
from pagedkv.sim.cost_model import CostModel, packaged_cost_model

CHAT = MultiTurnChat(num_system_prompts=4, num_conversations=12, num_turns=3, num_concurrent=12,
                     system_prompt_tokens=256, min_user_tokens=8, max_user_tokens=16, min_output_tokens=4,
                     max_output_tokens=8)


def _config(**options):
    return SchedulerConfig(num_blocks=48, block_size=16, max_model_len=CHAT.max_conversation_tokens,
                           max_num_seqs=2, **options)


def test_conversations_carry_their_history_into_the_next_turn():
    conversations = Conversations(CHAT)
    first = conversations.start()
    assert len(first) == 12 and first[0][1][:256] == CHAT.system_prompt(0)
    conversation, prompt, _ = first[0]
    follow = conversations.answered(conversation, [5, 6, 7])
    assert follow[0] == conversation and follow[1][:len(prompt) + 3] == prompt + [5, 6, 7]


def test_fixed_turns_carry_fixed_answers_turn_by_turn():
    turns = CHAT.fixed_turns()
    assert [(c, t) for c, t, _, _ in turns] == [(c, t) for t in range(3) for c in range(12)]
    by_turn = {(c, t): (prompt, answer_len) for c, t, prompt, answer_len in turns}
    for conversation in range(12):
        first, first_len = by_turn[conversation, 0]
        second, _ = by_turn[conversation, 1]
        answer = CHAT.answer(conversation, 0, first_len)
        assert len(answer) == first_len and second[:len(first) + first_len] == first + answer
        assert second[len(first) + first_len:] == CHAT.turn(conversation, 1)[1]
    assert CHAT.answer(0, 0, 8) != CHAT.answer(1, 0, 8) != CHAT.answer(0, 1, 8)


def test_a_host_tier_cuts_prefill_and_ttft_on_multi_turn_chat():
    cost = CostModel()
    gpu_only = simulate_chat(CHAT, _config(), cost)
    tiered = simulate_chat(CHAT, _config(num_offload_blocks=tier_blocks(64 * 2**20, cost, 16)), cost)
    assert gpu_only["num_requests"] == tiered["num_requests"] == 36
    assert tiered["host_hit_blocks"] > 0 and gpu_only["host_hit_blocks"] == 0
    assert tiered["prefill_tokens"] < gpu_only["prefill_tokens"]
    # A restored request waits one step for its copy; with prompts this long the prefill it saves is worth more.
    assert tiered["ttft_mean_s"] < gpu_only["ttft_mean_s"]


def test_a_spill_costs_its_step_the_gather_and_its_copy_to_the_host_only_past_the_step():
    cost = CostModel(kv_bytes_per_token=1000, d2h_bytes_per_s=1e8, h2d_bytes_per_s=1e8, gather_bytes_per_s=1e10)
    tokens = 2048
    out_s, gather_s = tokens * 1e-5, tokens * 1e-7  # 20.48 ms to the host, 0.2 ms to gather
    assert cost.tier_copy_s(1.0, offloaded_tokens=tokens, restored_tokens=0) == pytest.approx(gather_s)
    assert cost.tier_copy_s(0.01, offloaded_tokens=tokens, restored_tokens=0) == pytest.approx(gather_s + out_s - 0.01)
    # restores beside the step and the copies to the host run on two streams: the longer one counts
    assert cost.tier_copy_s(0.01, offloaded_tokens=tokens, restored_tokens=3000) == pytest.approx(gather_s + 0.02)
    # a pre-spill is gathered beside the step (the copy stream) and copied out on the out stream: all past the step
    assert cost.tier_copy_s(1.0, offloaded_tokens=0, restored_tokens=0, pre_spilled_tokens=tokens) == 0.0
    assert cost.tier_copy_s(0.01, offloaded_tokens=0, restored_tokens=0, pre_spilled_tokens=tokens) == (
        pytest.approx(gather_s + out_s - 0.01))
    # ... after the step's restores on the copy stream: its copy out waits for them, then for its gather
    assert cost.tier_copy_s(0.01, offloaded_tokens=0, restored_tokens=3000, pre_spilled_tokens=tokens) == (
        pytest.approx(0.03 + gather_s + out_s - 0.01))


def test_packaged_tier_bandwidths_are_labelled_placeholders_until_measured():
    cost = packaged_cost_model()
    assert cost.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2  # Qwen3-0.6B in bf16
    assert cost.tiers_measured is True  # the pinned copy bandwidths kv_tiers.sh measured on the H200


def test_sim_chat_tiers_command_writes_its_table(tmp_path, capsys):
    assert main(["sim", "--chat-tiers", "--chat-conversations", "6", "--chat-concurrent", "6", "--chat-turns", "2",
                 "--chat-system-len", "64", "--chat-gpu-blocks", "40", "--host-memory", "32MiB",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "GB/s (measured)" in text and "GPU + 0.03125 GiB host" in text
    rows = json.loads((tmp_path / "sim_chat_tiers.json").read_text())["rows"]
    assert [row["run"] for row in rows] == ["no prefix cache", "GPU only", "GPU + 0.03125 GiB host"]


def test_calc_sizes_the_tiers(capsys):
    assert main(["calc", "--model", "llama3-8b", "--kv-offload-memory", "64GiB", "--kv-offload-disk", "1TiB",
                 "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["kv_tiers"]
    per_block = 2 * 32 * 8 * 128 * 2 * 16  # Llama-3-8B bf16: 131,072 B per token, 16 tokens per block
    assert tiers["host_blocks"] == 64 * 2**30 // per_block and tiers["host_tokens"] == tiers["host_blocks"] * 16
    assert tiers["disk_tokens"] == 2**40 // per_block * 16
    first = tiers["prompts"][0]
    assert first["restore_s"] == pytest.approx(first["prompt_tokens"] * 131_072 / tiers["h2d_bytes_per_s"])


def test_calc_tiers_need_a_model(capsys):
    assert main(["calc", "--kv-offload-memory", "1GiB"]) == 2
    assert "--kv-offload-memory needs a model" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["3,2", "32,16,3,8192,0", "a,b,c,d,e"])
def test_a_bad_chat_size_is_one_line_naming_it(size, capsys):
    assert main(["bench", "engine", "--preset", "chat-tiers", "--smoke", "--chat-size", size]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and size in err and "C,K,T,S,F" in err


def test_chat_size_parses_five_positive_integers():
    from pagedkv.bench.engine import chat_size

    assert chat_size("32,16,3,8192,2") == (32, 16, 3, 8192, 2)
