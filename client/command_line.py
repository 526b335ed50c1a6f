"""The argument parser of every tierps command line (`tierps` and its subcommands, the
demo's trainers): no flag is matched by a prefix, and a usage error never shows a secret.
Here, below both the server's and the demo's commands, so that each imports it without
importing the other.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

HIDDEN = "<hidden>"
# A flag whose name has one of these words takes a secret (or a secret's file: hidden too).
_SECRET_FLAG = re.compile(
    r"(--?[\w-]*(?:token|secret|passw|key)[\w-]*)(=|\s+)(?!-)[^\s,]+", re.IGNORECASE
)
# ROLE:TOKEN as a tokens file holds it (roles of server/security.py), or any NAME:VALUE with
# a value as long as a token must be (MIN_TOKEN_CHARS); host:port and URLs stay.
_SECRET_WORD = re.compile(
    r"\b(admin|trainer|reader|[A-Za-z][\w.-]*(?=:(?!//)[^\s'\",]{16}))"
    r":(?!//)[^\s'\",]+"
)
TOKEN_HINT = (
    "a token is never taken on the command line, where a process list shows it: tierps serve "
    "and tierps cluster read ROLE:TOKEN lines from --tokens-file FILE or $TIERPS_TOKENS; "
    "clients (tierps admin, tierps demo) read their token from --token-file FILE, "
    "$TIERPS_TOKEN_FILE or $TIERPS_TOKEN"
)


def redact(text: str) -> str:
    """`text` (an error about a command line) with what may be a secret replaced by
    <hidden>: the value of a flag named like a secret (--token, --api-key), and ROLE:TOKEN
    literals."""
    text = _SECRET_FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{HIDDEN}", text)
    return _SECRET_WORD.sub(lambda m: f"{m.group(1)}:{HIDDEN}", text)


def _unrecognized(extras: Sequence[str]) -> tuple[str, str]:
    """argparse's "unrecognized arguments" error, but an unknown flag's value is not shown
    (the flag may be a mistyped secret one); and, for an unknown token flag, TOKEN_HINT
    (not to be redacted): (message, hint)."""
    words, hidden, after_flag = [], False, False
    for arg in extras:
        if arg.startswith("-") and len(arg) > 1 and not arg[1:2].isdigit():
            name, equals, _ = arg.partition("=")
            words.append(f"{name}={HIDDEN}" if equals else name)
            hidden, after_flag = hidden or bool(equals), not equals
        elif after_flag:
            words.append(HIDDEN)
            hidden, after_flag = True, False
        else:
            words.append(arg)
    message = f"unrecognized arguments: {' '.join(words)}"
    if hidden:
        message += f" (an unknown flag's value is shown as {HIDDEN}: it may be a secret)"
    tokens = any(w.startswith("-") and "token" in w.lower() for w in words)
    return message, f"; {TOKEN_HINT}" if tokens else ""


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of parser and of its subcommands, theirs too."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


class Parser(argparse.ArgumentParser):
    """The parser of every tierps command line (its subcommands' too: argparse makes them of
    their parent's class). A flag is never matched by a prefix (allow_abbrev off): `--token`
    would be taken for --tokens-file and the token read as a file name, and shown in its
    error. A usage error never shows a secret (redact)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = sys.argv[1:] if args is None else list(args)
        # A secret-named flag no subcommand has (--token) is refused before parsing: else
        # argparse skips it and may take its value for a subcommand or a positional.
        known = _option_strings(self)
        for at, arg in enumerate(argv):
            name = arg.partition("=")[0]
            if arg.startswith("-") and name not in known and _SECRET_FLAG.match(f"{name} x"):
                self._fail(*_unrecognized(argv[at : at + (1 if "=" in arg else 2)]))
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            self._fail(*_unrecognized(extras))
        return parsed

    def error(self, message: str) -> NoReturn:
        self._fail(message)

    def _fail(self, message: str, hint: str = "") -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact(message)}{hint}\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help that shows each option's default, unless it has none (None, False) or its
    help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        none = action.default is None or action.default is False
        if (
            action.option_strings
            and not none
            and action.default is not argparse.SUPPRESS
            and "default" not in help
        ):
            help += " (default: %(default)s)"
        return help
