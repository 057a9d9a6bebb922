"""Where a decode step's time goes (GPU): launch overheads and a torch.profiler table. Prints only."""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedkv import LLM, SamplingParams
from pagedkv.hf import PagedCache, PagePool, random_model
from pagedkv.kernels import paged_decode_attention, write_kv


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


dev = "cuda"
kc = torch.zeros(256, 16, 8, 128, dtype=torch.bfloat16, device=dev)
vc = torch.zeros_like(kc)
k = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=dev)
slots = torch.arange(4, device=dev)
q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device=dev)
bt = torch.arange(32, dtype=torch.int32, device=dev).view(4, 8)
sl = torch.full((4,), 100, dtype=torch.int32, device=dev)
out = torch.empty_like(q)
print(f"write_kv (validate=False): {per_call_us(lambda: write_kv(k, k, kc, vc, slots, validate=False)):.1f} us/call")
print(f"decode (validate=False): {per_call_us(lambda: paged_decode_attention(q, kc, vc, bt, sl, scale=0.1, max_seq_len=100, out=out, validate=False)):.1f} us/call")
print(f"decode (validate=True): {per_call_us(lambda: paged_decode_attention(q, kc, vc, bt, sl, scale=0.1, max_seq_len=100, out=out)):.1f} us/call")
a = torch.randn(4, 8, 100, 128, dtype=torch.bfloat16, device=dev)
print(f"torch.cat: {per_call_us(lambda: torch.cat([a, a[:, :, :1]], dim=2)):.1f} us/call")

model = random_model("qwen3-0.6b", torch.bfloat16, dev)
llm = LLM(hf_model=model, kv_cache_memory=0.2, max_model_len=2048)
prompts = [[(i * 7 + j) % 1000 for j in range(200)] for i in range(64)]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
llm.generate(prompts, params)
engine = llm.engine
for i, p in enumerate(prompts):
    engine.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
for _ in range(3):
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        t = time.perf_counter()
        engine.step()
        print(f"engine decode step (64 seqs): {(time.perf_counter() - t) * 1e3:.2f} ms")
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
while engine.has_unfinished_requests():
    engine.step()

gpt2 = random_model("gpt2", torch.float16, dev)
pool = PagePool.for_model(gpt2, num_blocks=512)
ids = torch.randint(0, 50000, (1, 10), device=dev)
for _ in range(2):
    with PagedCache(pool) as cache:
        gpt2.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with PagedCache(pool) as cache:
        gpt2.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
