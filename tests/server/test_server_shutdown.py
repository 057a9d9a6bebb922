"""`pagedkv serve` as a process: SIGTERM drains open streams, then ends them cleanly (issue 14, defect 6).

A real subprocess, because signals, uvicorn's shutdown and the exit status are the subject.
The model is a random SmolLM2-135M (slow enough on CPU that a long stream is still open when
the grace period ends, and no download).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    process = subprocess.Popen([sys.executable, "-m", "pagedkv", "serve", "random:smollm2-135m", "--port", "0",
                                "--device", "cpu", "--kv-cache-memory", "32MiB", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        match = re.search(r"serving .* on (http://[\d.]+:\d+)/v1", line)
        if match:
            url = match.group(1)
            break
        assert time.monotonic() < deadline, "".join(lines)
    else:
        raise AssertionError("the server exited before serving:\n" + "".join(lines))
    while True:  # uvicorn starts listening just after the log line
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
        time.sleep(0.1)
    process.log = lines
    return process, url


@pytest.mark.slow
def test_sigterm_ends_open_streams_with_an_error_event_then_done():
    process, url = _start("--shutdown-timeout", "1")
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 700, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        frames = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            frames.append(next(line for line in lines if line))
            process.send_signal(signal.SIGTERM)
            frames += [line for line in lines if line]
        rest = process.stdout.read()
        status = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(process.log) + rest
    assert frames[-1] == "data: [DONE]", frames[-3:]
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert len(frames) > 3 and all("error" not in frame for frame in frames[:-2])
    assert "Traceback" not in log and "Exception" not in log, log
    # uvicorn re-raises the signal once it has shut down, so the exit is SIGTERM's (or 0)
    assert status in (0, -signal.SIGTERM), log
