"""The image's install step, without a Docker daemon: the build context is the repository
filtered by deploy/Dockerfile.dockerignore (Docker's rules: patterns in order, the last
match wins, `!` re-includes, a pattern matching a directory covers what is under it), the
Dockerfile's COPY instructions before its `pip install` lay that context out as the image
would, and a wheel is built from exactly that tree. It must hold every package
pyproject.toml names, with their modules, so `pip install` in the image cannot stop at a
missing package directory (as it did for tierps.demo)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over a path and, as
    Docker does, over each of its parent directories."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")


def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) per line of the dockerignore, in order."""
    rules = []
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        cleaned = str(PurePosixPath(line.lstrip("!").strip("/")))
        rules.append((not keep, _pattern(cleaned)))
    return rules


def context_files() -> list[str]:
    """The repository files (as git lists them, committed or not) left in the build
    context by the dockerignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    rules = ignore_rules()
    kept = []
    for path in listed:
        excluded = False
        for excludes, pattern in rules:
            if pattern.fullmatch(path):
                excluded = excludes
        if not excluded and (ROOT / path).is_file():
            kept.append(path)
    return kept


def test_dockerignore_rules_read_as_docker_reads_them() -> None:
    """The matcher itself, on the rules' own cases: everything excluded, then the listed
    folders back, then caches out again wherever they are."""
    files = set(context_files())
    assert "pyproject.toml" in files and "demo/main.py" in files
    assert not any(f.startswith(("tests/", ".git/", "docs/")) for f in files), sorted(files)
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)


def test_the_wheel_built_from_what_the_dockerfile_copies_holds_every_package(
    tmp_path: Path,
) -> None:
    context = set(context_files())
    image = tmp_path / "image"
    install_source = None
    for word, rest in instructions():
        if word == "COPY":
            *sources, target = shlex.split(rest)
            assert not any(s.startswith("--") for s in sources), f"COPY {rest}: flags unread"
            for source in sources:
                source = source.rstrip("/")
                below = [f for f in context if f == source or f.startswith(source + "/")]
                assert below, f"COPY {source}: nothing of it is in the build context"
                for path in below:
                    if path == source:  # a file: into the target directory (ends in /)
                        destination = image / target.lstrip("/") / Path(path).name
                    else:  # a directory: its content into the target
                        destination = image / target.lstrip("/") / path[len(source) + 1 :]
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(ROOT / path, destination)
        elif word == "RUN" and "pip install" in rest:
            install_source = next(  # the folder, without the extras ("/tmp/src[server]")
                arg.partition("[")[0]
                for arg in shlex.split(rest.split("&&")[0])
                if arg.startswith("/")
            )
            break
    assert install_source is not None, "no RUN pip install of a copied folder"
    source = image / install_source.lstrip("/")
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-w",
            str(wheels),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert built.returncode == 0, f"{built.stdout}\n{built.stderr}"
    (wheel,) = wheels.glob("tierps-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools["package-dir"].items():
        assert package in setuptools["packages"]
        modules = sorted(p.name for p in (ROOT / folder).glob("*.py"))
        assert modules, folder
        for module in modules:
            member = f"{package.replace('.', '/')}/{module}"
            assert member in names, f"{member} (from {folder}/) is not in the image's wheel"
