"""Where does tensor parallelism on two GPUs stop? Runs TP=2 on a tiny model, eager or with graphs, dumping stacks."""
import faulthandler
import os
import sys
import time

import torch

faulthandler.dump_traceback_later(float(os.environ.get("PAGEDKV_HANG_DUMP_S", "30")), exit=False)
from pagedkv import LLM, SamplingParams  # noqa: E402

eager = sys.argv[1] == "eager"
start = time.perf_counter()
llm = LLM("random:tiny-llama", dtype="float32", tensor_parallel_size=2, kv_cache_memory=64 * 2**20,
          max_model_len=256, max_num_seqs=8, enforce_eager=eager)
print(f"startup {time.perf_counter() - start:.1f} s, graphs {len(llm.engine.runner.graphs)}", flush=True)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("tokens", out[0].outputs[0].token_ids, flush=True)
ref = LLM("random:tiny-llama", dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=8,
          enforce_eager=eager).generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("tp1   ", ref[0].outputs[0].token_ids, flush=True)
llm.engine.shutdown()
print("done", flush=True)
