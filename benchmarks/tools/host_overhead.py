"""Host time of one engine decode step with the device taken out: what the Python side costs per step.

The runner's `execute` is replaced by a stub that returns a token per sampling row at once, so the
step's phases (`LLMEngine.step_timings`) measure only schedule, StepInput building, staging-free
launch bookkeeping, resolve and outputs. Usage: python benchmarks/tools/host_overhead.py [BATCH] [STEPS]
"""

import statistics
import sys
import time

from pagedkv import LLM, SamplingParams
from pagedkv.engine.outputs import STEP_PHASES


class InstantResult:
    """A step's sampled tokens in place of the runner's output, ready at once: one token per sampling row."""

    def __init__(self, num_rows: int):
        self._tokens = [[7] for _ in range(num_rows)]
        self.device_tokens = None

    def ready(self) -> bool:
        return True

    def token_ids(self):
        return self._tokens

    def logprobs(self):
        return None


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    llm = LLM("random:tiny-qwen3", device="cpu", block_size=16, num_blocks=batch * 30, max_num_seqs=batch,
              max_num_batched_tokens=8192)
    engine = llm.engine
    engine.stream_outputs = False
    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(i * 7 + j) % 400 + 3 for j in range(128)], params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.runner.execute = lambda step, previous=None: (InstantResult(len(step.sample_seqs))
                                                         if step.sample_seqs else None)
    engine.step_timings = []
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    timings = [t for t in engine.step_timings if t.shape.decode_seqs == batch]
    phases = {name[:-2]: statistics.median(getattr(t, name) for t in timings) * 1e3
              for name in STEP_PHASES}
    print(f"batch {batch}: {wall * 1e3:.3f} ms per step on the host; " +
          ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
