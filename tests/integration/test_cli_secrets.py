"""A secret given on a command line is refused and never echoed: no flag is matched by a
prefix (`--token` is not --tokens-file), a usage error hides secret values, and a serving
shard's log holds none of its tokens. Real `tierps` subprocesses; their stdout and stderr
(the JSON log) are searched for the secret."""

from __future__ import annotations

import argparse
import ast
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.commands import serve_command
from tierps.client.command_line import Parser
from tierps.demo import trainers
from tierps.server import cli

pytestmark = pytest.mark.slow  # real `tierps` subprocesses

TIMEOUT_S = 60.0
SECRET = "s3cret-do-not-print-0123456789"
ROOT = Path(__file__).resolve().parents[2]


def tierps(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierps.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def test_no_parser_matches_a_flag_by_its_prefix() -> None:
    parsers = _parsers(cli.build_parser()) + _parsers(trainers._parser())
    assert len(parsers) > 15  # serve, cluster, admin and its actions, snapshot's verbs, ...
    for parser in parsers:
        assert parser.allow_abbrev is False, parser.prog
        assert isinstance(parser, Parser), parser.prog


def test_every_argument_parser_of_the_repository_turns_prefixes_off() -> None:
    """Scripts outside the `tierps` command (benchmarks, test helpers) too."""
    sources = [
        path
        for folder in ("server", "client", "demo", "storage", "tests")
        for path in (ROOT / folder).rglob("*.py")
    ]
    calls = 0
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name != "ArgumentParser":
                continue
            calls += 1
            keywords = {k.arg: k.value for k in node.keywords}
            value = keywords.get("allow_abbrev")
            assert isinstance(value, ast.Constant) and value.value is False, (
                f"{path.relative_to(ROOT)}:{node.lineno}: ArgumentParser(...) expected "
                "allow_abbrev=False (or tierps.client.command_line.Parser), got none"
            )
    assert calls >= 10


@pytest.mark.parametrize(
    "args",
    [
        [
            "serve",
            "--shard-id",
            "0",
            "--num-shards",
            "1",
            "--data-dir",
            "d",
            "--token",
            f"admin:{SECRET}",
        ],
        ["serve", f"--token=admin:{SECRET}"],
        ["serve", "--tokens", f"admin:{SECRET}"],  # a prefix of --tokens-file
        ["cluster", "--shards", "1", "--data-dir", "d", "--token", f"admin:{SECRET}"],
        ["admin", "--token", SECRET, "tables"],
        ["admin", "tables", "--token", f"trainer:{SECRET}"],
        ["admin", "--token-f", SECRET, "tables"],  # a prefix of --token-file
        ["demo", "--token", SECRET],
    ],
    ids=lambda args: " ".join(a for a in args if SECRET not in a),
)
def test_a_token_on_the_command_line_is_refused_and_not_echoed(args: list[str]) -> None:
    done = tierps(*args)
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr
    flag = next(a for a in args if a.startswith("--tok")).partition("=")[0]
    assert f"unrecognized arguments: {flag}" in done.stderr, done.stderr
    assert "--tokens-file FILE or $TIERPS_TOKENS" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--port", f"admin:{SECRET}"], "invalid int value: 'admin:<hidden>'"),
        (["admin", f"reader:{SECRET}"], "invalid choice: 'reader:<hidden>'"),
        (["admin", "tables", "--api-key", SECRET], "unrecognized arguments: --api-key <hidden>"),
        (["serve", "--passwrd", SECRET], "unrecognized arguments: --passwrd <hidden>"),
    ],
)
def test_a_usage_error_hides_what_may_be_a_secret(args: list[str], expected: str) -> None:
    done = tierps(*args)
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert expected in done.stderr, done.stderr


def test_a_token_given_as_the_tokens_file_is_not_echoed(tmp_path: Path) -> None:
    done = tierps(
        "serve",
        "--shard-id",
        "0",
        "--num-shards",
        "1",
        "--data-dir",
        str(tmp_path / "d"),
        "--tokens-file",
        f"admin:{SECRET}",
    )
    assert done.returncode == 1, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "admin:<hidden>" in done.stderr  # the log line and the message
    log = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert any(entry["msg"].startswith("cannot serve:") for entry in log), done.stderr


def test_a_serving_shard_logs_none_of_its_tokens(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin:{SECRET}\nreader:{SECRET}-reader\n")
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        serve_command(
            str(tmp_path / "d"),
            "--tokens-file",
            str(tokens),
            "--port-file",
            str(port_file),
            "--log-level",
            "debug",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not port_file.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), "the shard did not start"
        port = json.loads(port_file.read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # refused, and logged
            call = channel.unary_unary("/tierps.v1.AdminService/ListTables")
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", timeout=10, metadata=[("authorization", f"Bearer wrong-{SECRET}")])
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "serving at 127.0.0.1:" in out
    messages = [json.loads(line)["msg"] for line in err.splitlines() if line.startswith("{")]
    assert "serving" in messages and "stopped" in messages, err
    assert SECRET not in out + err
