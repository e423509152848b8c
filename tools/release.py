#!/usr/bin/env python3
"""Tag a release: the version the hosted notebooks install (``make release``, ``make release VERSION=0.2.0``).

    python3 tools/release.py                 # release pyproject's version as it is
    python3 tools/release.py 0.2.0           # move the version on first, then release it
    python3 tools/release.py 0.2.0 --date 2026-01-31

A hosted notebook's setup cell installs ``minifer @ git+<Repository>@v<version>`` and its badges open the notebook
at that tag (``tools/stamp_hosted.py``), so a release is what a Colab learner gets. The steps, on a clean working
tree (else nothing is done):

1. a new version is written into ``pyproject.toml`` and every notebook is re-stamped for its tag (the setup
   cells' stored outputs are kept: in a clone they print the same whatever the tag);
2. ``CHANGELOG.md`` gets an entry on top: the version, the date, and the subject of every commit since the
   previous release tag (all commits for the first);
3. one commit, "Release v<version>", and an annotated tag ``v<version>``. Pushing both is left to you:
   ``git push && git push origin v<version>``.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import stamp_hosted  # noqa: E402 - the tools folder is not a package

HEADER = "# Changelog\n\nEach release is a git tag; a hosted notebook's setup cell installs the tag its badges name.\n"
_VERSION = re.compile(r'^version = "([^"]+)"$', re.M)


class ReleaseError(RuntimeError):
    """Why nothing was released."""


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def set_version(root: Path, version: str) -> str:
    """Write ``version`` into pyproject.toml's [project]; returns the version it had."""
    path = root / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    old = _VERSION.search(text)
    if old is None:
        raise ReleaseError("pyproject.toml has no `version = \"...\"` line")
    path.write_text(_VERSION.sub(f'version = "{version}"', text, count=1), encoding="utf-8")
    return old[1]


def changes_since_last_tag(root: Path) -> tuple[str | None, list[str]]:
    """The previous release tag (None for the first) and the subjects of the commits since, oldest first."""
    tags = [t for t in git(root, "tag", "--list", "v*", "--sort=-creatordate").splitlines() if t]
    span = f"{tags[0]}..HEAD" if tags else "HEAD"
    return (tags[0] if tags else None), git(root, "log", "--reverse", "--format=%s", span).splitlines()


def changelog_entry(tag: str, date: str, previous: str | None, subjects: list[str]) -> str:
    since = f"since {previous}" if previous else "the first release"
    lines = [f"## {tag} ({date})", "", f"{len(subjects)} commit(s), {since}:", ""]
    return "\n".join(lines + [f"- {s}" for s in subjects] + [""])


def write_changelog(root: Path, entry: str) -> None:
    path = root / "CHANGELOG.md"
    body = path.read_text(encoding="utf-8") if path.exists() else HEADER
    head, sep, rest = body.partition("\n## ")
    path.write_text(f"{head.rstrip()}\n\n{entry}" + (f"\n## {rest}" if sep else ""), encoding="utf-8")


def release(root: Path, version: str | None, date: str) -> str:
    """Steps 1-3 above; returns the tag."""
    if git(root, "status", "--porcelain"):
        raise ReleaseError("the working tree has changes: commit or stash them first")
    version = version or stamp_hosted.read_config(root / "pyproject.toml").tag[1:]
    tag = f"v{version}"
    if tag in git(root, "tag", "--list", tag).splitlines():
        raise ReleaseError(f"{tag} exists already: give a new version (make release VERSION=...)")
    previous, subjects = changes_since_last_tag(root)
    set_version(root, version)
    stamp_hosted.stamp_all(root)
    write_changelog(root, changelog_entry(tag, date, previous, subjects))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", f"Release {tag}")
    git(root, "tag", "-a", tag, "-m", f"minifer {tag}")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", help="the new version (default: pyproject.toml's)")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="the entry's date (YYYY-MM-DD)")
    args = parser.parse_args(argv)
    try:
        tag = release(ROOT, args.version, args.date)
    except ReleaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"tagged {tag}; CHANGELOG.md has its entry. Publish: git push && git push origin {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
