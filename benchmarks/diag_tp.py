"""Where does tensor parallelism on two GPUs stop? TP=2 on a tiny model, eager or with graphs, with stack dumps.

Usage: PAGEDKV_HANG_DUMP_S=35 python benchmarks/diag_tp.py eager|graphs (workers dump their stacks too).
"""
import faulthandler
import os
import sys
import time


def main() -> None:
    from pagedkv import LLM, SamplingParams

    faulthandler.dump_traceback_later(float(os.environ.get("PAGEDKV_HANG_DUMP_S", "30")), exit=False)
    eager = sys.argv[1] == "eager"
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=8, enforce_eager=eager)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM("random:tiny-llama", tensor_parallel_size=2, **options)
    print(f"startup {time.perf_counter() - start:.1f} s, graphs {len(llm.engine.runner.graphs)}", flush=True)
    print("tp2", llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids, flush=True)
    print("tp1", LLM("random:tiny-llama", **options).generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids,
          flush=True)
    llm.engine.shutdown()


if __name__ == "__main__":  # spawned workers import this file again
    main()
