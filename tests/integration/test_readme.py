"""Every code block of README.md runs as written, so the README cannot drift from the code.

The blocks run in one scratch directory, in the README's order, against the cluster the
README itself starts (its `tierps cluster` block, marked `first`: the text asks a reader to
start it before the snippets above it), with TIERPS_ADDRESSES taken from the export line
that command prints. An HTML comment right above a block says how to run it:

- (none): ```python runs in this process (as pasted into a Python prompt), ```bash with
  `bash -e -o pipefail`, the `tierps` of this environment first on PATH; it must succeed.
- `readme-test: skip: WHY`: not run; WHY must be given (installs, benchmarks).
- `readme-test: file NAME`: the block is a file other blocks use; it is written as NAME.
- `readme-test: [first, ]background until "TEXT"`: a command that runs until stopped; it
  runs in the background until its output shows TEXT, and is stopped with SIGINT (Ctrl-C)
  at the end, which must end it with exit status 0.

A block of any other language, or with an unknown marker, fails the test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every README block against a live subprocess cluster

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```",
    re.S | re.M,
)
BACKGROUND = re.compile(r'(?P<first>first, )?background until "(?P<text>[^"]+)"')
COMMAND_TIMEOUT_S = 120.0


@dataclass
class Block:
    line: int
    lang: str
    marker: str
    code: str

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(text.count("\n", 0, m.start("code")), m["lang"], m["marker"] or "", m["code"])
        for m in BLOCK.finditer(text)
    ]


def test_every_block_is_run_or_says_why_not() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 8, [b.where for b in blocks]
    for block in blocks:
        marker = block.marker
        if marker.startswith("skip:"):
            assert marker[len("skip:") :].strip(), f"{block.where}: skip without a reason"
        elif marker.startswith("file "):
            assert marker[len("file ") :].strip(), f"{block.where}: file without a name"
        elif marker:
            assert BACKGROUND.fullmatch(marker), f"{block.where}: unknown marker {marker!r}"
            assert block.lang == "bash", f"{block.where}: a background block is a command"
        else:
            assert block.lang in ("python", "bash"), (
                f"{block.where}: a ```{block.lang} block must be marked (file, skip)"
            )


def test_the_venv_is_activated_before_a_block_runs_bare_tierps_or_python() -> None:
    """The first block makes .venv and calls .venv/bin/tierps; the later blocks call bare
    `tierps` and `python`, found only in an activated venv: the text between says so."""
    text = README.read_text()
    blocks = list(BLOCK.finditer(text))
    (setup,) = [m for m in blocks if "python3 -m venv .venv" in m["code"]]
    bare = re.compile(r"^(?:tierps|python) ", re.M)
    later = next(
        m
        for m in blocks
        if m.start() > setup.end() and (m["lang"] == "python" or bare.search(m["code"]))
    )
    between = text[setup.end() : later.start()]
    assert "source .venv/bin/activate" in between, between


class Background:
    """A command started by a `background until` block: its output is read until it shows
    TEXT; stop() sends SIGINT (Ctrl-C) and returns its exit status."""

    def __init__(self, block: Block, cwd: Path, env: dict[str, str], text: str) -> None:
        self.block = block
        self.process = subprocess.Popen(
            ["bash", "-e", "-c", block.code],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.output = ""
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while text not in self.output:
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                pytest.fail(f"{block.where}: {text!r} never came; output:\n{self.output}")
            if selector.select(timeout=0.5):  # unbuffered: nothing waits in a buffer
                self.output += os.read(self.process.stdout.fileno(), 1 << 16).decode(
                    errors="replace"
                )
        selector.close()

    def stop(self) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            code = self.process.wait(COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self.output += self.process.stdout.read().decode(errors="replace")
        self.process.stdout.close()
        return code


def test_every_block_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [b for b in readme_blocks() if not b.marker.startswith("skip:")]
    first = [b for b in blocks if (m := BACKGROUND.fullmatch(b.marker)) and m["first"]]
    assert len(first) == 1, "one block starts the cluster the others run against"
    env = {**os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("TIERPS_ADDRESSES", None)
    monkeypatch.chdir(tmp_path)
    started: list[Background] = []
    try:
        for block in first + [b for b in blocks if b not in first]:
            background = BACKGROUND.fullmatch(block.marker)
            if block.marker.startswith("file "):
                (tmp_path / block.marker[len("file ") :].strip()).write_text(block.code)
            elif background:
                started.append(Background(block, tmp_path, env, background["text"]))
                exported = re.search(r"^export TIERPS_ADDRESSES=(\S+)$", started[-1].output, re.M)
                if exported:
                    env["TIERPS_ADDRESSES"] = exported.group(1)
                    monkeypatch.setenv("TIERPS_ADDRESSES", exported.group(1))
            elif block.lang == "python":
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(block.code, block.where, "exec"), {"__name__": "__readme__"})
                assert printed.getvalue().strip(), (
                    f"{block.where}: expected the block to print what it did (a reader cannot "
                    f"tell it worked otherwise), got no output"
                )
            else:
                result = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", block.code],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=COMMAND_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                )
                assert result.returncode == 0, (
                    f"{block.where} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
                )
                assert "Traceback" not in result.stderr, f"{block.where}:\n{result.stderr}"
    finally:
        codes = [(b.block.where, b.stop(), b.output) for b in reversed(started)]
    for where, code, output in codes:
        assert code == 0, f"{where}: Ctrl-C ended it with {code}; output:\n{output}"
    assert not (tmp_path / "cluster" / "addresses").exists(), "a stopped cluster's addresses"
