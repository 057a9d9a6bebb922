"""A live uvicorn server for the server tests: real HTTP on 127.0.0.1, the app's lifespan runs the engine thread."""

import functools
import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.hf import load_tokenizer, random_model


class LiveServer:
    """uvicorn on a free 127.0.0.1 port, in a background thread; the app's lifespan runs the engine thread."""

    def __init__(self, app):
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()

    @property
    def async_engine(self):
        return self.app.state.async_engine

    def on_engine(self, fn, timeout_s: float = 30):
        """Run `fn(engine)` on the engine thread and return its result."""
        return self.async_engine.call(fn).result(timeout_s)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, by name (labels folded into the name)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
                if "le" in sample.labels:
                    continue
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return samples

    def wait_idle(self, timeout_s: float = 20) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if (m["pagedkv_num_requests_running"] == 0 and m["pagedkv_num_requests_waiting"] == 0
                    and m["pagedkv_kv_cache_used_blocks"] == 0):
                return m
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.05)


def delta(before: dict, after: dict, name: str) -> float:
    """How much a metric sample moved between two `LiveServer.metrics()` snapshots."""
    return after.get(name, 0.0) - before.get(name, 0.0)


@functools.lru_cache(maxsize=None)
def tiny_chat_model():
    """A tiny random llama with SmolLM2's vocabulary, and SmolLM2's tokenizer (which has a chat template).

    Text prompts, chat and /tokenize need a real tokenizer; the random weights keep the model fast.
    """
    tokenizer = load_tokenizer(None)
    model = random_model("tiny-llama", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return model, tokenizer
