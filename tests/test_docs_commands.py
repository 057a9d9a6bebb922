"""Every runnable command in README.md and docs/*.md runs as written (issue 23).

The blocks are read from the markdown, so the docs cannot drift from the code:

- a fenced block with info string `bash` is run one command per line (`#` comment lines
  skipped, a trailing backslash joins the next line); `pagedkv ...` runs as
  `python -m pagedkv ...` and `python` as this interpreter;
- a `python` block runs as a script in a fresh interpreter;
- other blocks (`text`, no info string) are not run.

An HTML comment on the line directly before the fence controls a block:

    <!-- doc-test: skip: REASON -->    not run
    <!-- doc-test: gpu -->             run only where torch sees a CUDA GPU
    <!-- doc-test: exit=N -->          every command must exit with N (default 0)

Commands run in a fresh temporary directory with `PAGEDKV_OUT` there, so nothing writes into
the checkout. An unmarked block that would install packages, recurse into make, clone, need a
running server or start one fails with a message telling the author how to mark it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Per command (or python block): documented commands are meant to be quick variants.
COMMAND_TIMEOUT_S = 300

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
#: Commands a doc may show but the test must not run unmarked: (pattern, why).
_NEEDS_MARKER = [
    (re.compile(r"(^|[;&|(]\s*)make\b"), "runs make (slow, and recursive under `make test`)"),
    (re.compile(r"(^|[;&|(]\s*)(pip3?|uv|pipx)\b|-m pip\b"), "installs packages"),
    (re.compile(r"(^|[;&|(]\s*)git\s+clone\b"), "clones a repository (network)"),
    (re.compile(r"(^|[;&|(]\s*)(curl|wget|http)\b"), "needs a running server or the network"),
    (re.compile(r"(^|[;&|(]\s*)pagedkv\s+serve\b(?!.*\s(-h|--help)\b)"), "starts a long-running server"),
]


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its commands (bash) or source (python), its marker."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    body: str
    marker: str | None

    @property
    def id(self) -> str:
        name = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{name}:{self.line}"

    @property
    def expected_exit(self) -> int:
        match = re.fullmatch(r"exit\s*=\s*(\d+)", self.marker or "")
        return int(match.group(1)) if match else 0

    def commands(self) -> list[str]:
        """The block's command lines: continuations joined, comments and blank lines dropped."""
        commands, pending = [], ""
        for raw in self.body.splitlines():
            line = pending + raw.strip() if pending else raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            if line and not line.startswith("#"):
                commands.append(line)
        if pending.strip():
            commands.append(pending.strip())
        return commands


def read_blocks(path: Path) -> list[Block]:
    """The `bash` and `python` fenced blocks of one markdown file, with the marker line before each."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, language = match.group(1), match.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        previous = lines[i - 1].strip() if i > 0 else ""
        marker = _MARKER.match(previous)
        if language in ("bash", "python"):
            blocks.append(Block(path, i + 1, language, "\n".join(lines[i + 1:end]),
                                marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOC_FILES if path.is_file() for block in read_blocks(path)]


def _check_marker(block: Block) -> None:
    marker = block.marker
    if marker is None or marker == "gpu" or marker.startswith("skip:") or re.fullmatch(r"exit\s*=\s*\d+", marker):
        return
    pytest.fail(f"{block.id}: unknown doc-test marker {marker!r}; use 'skip: REASON', 'gpu' or 'exit=N'")


def _refuse_unmarked(block: Block) -> None:
    """Fail loudly on a command the test must not run, naming the marker to add."""
    for command in block.commands() if block.language == "bash" else []:
        for pattern, why in _NEEDS_MARKER:
            if pattern.search(command):
                pytest.fail(f"{block.id}: `{command}` {why}; mark the block with "
                            f"<!-- doc-test: skip: REASON --> on the line before its fence, or show a command "
                            f"that runs here")


def _environment(tmp_path: Path) -> tuple[dict, Path]:
    """PATH with `pagedkv` and `python` shims for this interpreter; results under tmp_path."""
    shims = tmp_path / ".shims"
    shims.mkdir()
    for name, target in (("pagedkv", f'"{sys.executable}" -m pagedkv'), ("python", f'"{sys.executable}"'),
                         ("python3", f'"{sys.executable}"')):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
           "PAGEDKV_OUT": str(tmp_path / "results"), "PYTHONUNBUFFERED": "1"}
    return env, work


def _run(argv: list[str], block: Block, what: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: `{what}` ran past {COMMAND_TIMEOUT_S} s; show a quick variant in the doc or mark "
                    f"the block <!-- doc-test: skip: REASON -->")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_documented_block_runs(block: Block, tmp_path):
    _check_marker(block)
    if block.marker is not None and block.marker.startswith("skip:"):
        pytest.skip(f"marked skip: {block.marker[5:].strip()}")
    if block.marker == "gpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("marked gpu; no CUDA GPU here")
    _refuse_unmarked(block)
    env, work = _environment(tmp_path)
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.body, encoding="utf-8")
        result = _run([sys.executable, str(script)], block, "the python block", work, env)
        assert result.returncode == block.expected_exit, (
            f"{block.id}: the python block exited {result.returncode}, expected {block.expected_exit}\n"
            f"{result.stderr[-3000:]}")
        return
    commands = block.commands()
    assert commands, f"{block.id}: a bash block with no commands"
    for command in commands:
        result = _run(["bash", "-c", command], block, command, work, env)
        assert result.returncode == block.expected_exit, (
            f"{block.id}: `{command}` exited {result.returncode}, expected {block.expected_exit}\n"
            f"stdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-3000:]}")


# ---------------------------------------------------------------------- the reader itself
def test_reader_joins_continuations_and_reads_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n<!-- doc-test: exit=2 -->\n```bash\n# a comment\npagedkv calc \\\n  --model gpt2\n\n"
                   "pagedkv --version\n```\n\n```text\nnot run\n```\n```python\nprint(1)\n```\n")
    blocks = read_blocks(doc)
    assert [(b.line, b.language, b.marker) for b in blocks] == [(3, "bash", "exit=2"), (14, "python", None)]
    assert blocks[0].commands() == ["pagedkv calc --model gpt2", "pagedkv --version"]
    assert blocks[0].expected_exit == 2 and blocks[1].expected_exit == 0


@pytest.mark.parametrize("command", ["make demo", "pip install -e .", "python -m pip install x",
                                     "git clone https://x/y && cd y", "curl localhost:8000/health",
                                     "pagedkv serve --port 8000"])
def test_unmarked_installs_and_servers_fail_loudly(command, tmp_path):
    block = Block(tmp_path / "doc.md", 1, "bash", command, None)
    with pytest.raises(pytest.fail.Exception, match="doc-test: skip"):
        _refuse_unmarked(block)
    _refuse_unmarked(Block(tmp_path / "doc.md", 1, "bash", "pagedkv serve --help", None))
