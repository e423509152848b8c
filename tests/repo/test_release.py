"""``make release`` (``tools/release.py``) in a temporary git repository: it moves the version on, re-stamps the
notebooks for the new tag, writes a changelog entry of the commits since the last tag, commits and tags; it refuses
a dirty tree and a tag that exists."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402
import stamp_hosted  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture
def repo(tmp_path):
    """A repository with minifer's pyproject.toml, one chapter (stamped for v0.1.0, its setup cell run) and two
    commits; git's identity is set in its config."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    release.set_version(tmp_path, "0.1.0")
    (tmp_path / "notebooks").mkdir()
    nb = new_notebook(cells=[new_markdown_cell("# 00 · Title"), new_code_cell("x = 1")])
    nb = stamp_hosted.stamp(nb, "notebooks/00_x.ipynb", stamp_hosted.read_config(tmp_path / "pyproject.toml"))
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="minifer: using this clone\n")]
    nbformat.write(nb, tmp_path / "notebooks" / "00_x.ipynb")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for key, value in (("user.name", "Test"), ("user.email", "test@example.com"), ("commit.gpgsign", "false"),
                       ("tag.gpgsign", "false")):
        release.git(tmp_path, "config", key, value)
    release.git(tmp_path, "add", "-A")
    release.git(tmp_path, "commit", "-q", "-m", "First chapter")
    (tmp_path / "README.md").write_text("minifer\n")
    release.git(tmp_path, "add", "-A")
    release.git(tmp_path, "commit", "-q", "-m", "A README")
    return tmp_path


def test_a_release_tags_stamps_and_writes_the_changelog(repo):
    assert release.release(repo, None, "2026-01-02") == "v0.1.0"
    assert release.git(repo, "tag", "--list") == "v0.1.0"
    assert release.git(repo, "log", "-1", "--format=%s") == "Release v0.1.0"
    assert release.git(repo, "status", "--porcelain") == ""
    log = (repo / "CHANGELOG.md").read_text()
    assert log.startswith("# Changelog\n") and "## v0.1.0 (2026-01-02)\n\n2 commit(s), the first release:\n\n" \
        "- First chapter\n- A README\n" in log

    (repo / "README.md").write_text("minifer, the course\n")
    release.git(repo, "commit", "-qam", "README: the course")
    assert release.release(repo, "0.2.0", "2026-02-03") == "v0.2.0"
    log = (repo / "CHANGELOG.md").read_text()
    assert log.index("## v0.2.0 (2026-02-03)") < log.index("## v0.1.0")  # newest first, the old entry kept
    assert "1 commit(s), since v0.1.0:\n\n- README: the course\n" in log and log.count("# Changelog") == 1
    assert 'version = "0.2.0"' in (repo / "pyproject.toml").read_text()
    nb = nbformat.read(repo / "notebooks" / "00_x.ipynb", 4)
    assert "@v0.2.0\"" in nb.cells[1].source and "/blob/v0.2.0/notebooks/00_x.ipynb" in nb.cells[0].source
    assert nb.cells[1].outputs[0]["text"] == "minifer: using this clone\n"  # stamping kept the stored output
    assert stamp_hosted.stamp_all(repo, check=True) == ([], [])


def test_a_release_refuses_a_dirty_tree_and_an_existing_tag(repo):
    (repo / "README.md").write_text("changed\n")
    with pytest.raises(release.ReleaseError, match="working tree has changes"):
        release.release(repo, None, "2026-01-02")
    release.git(repo, "checkout", "--", "README.md")
    release.release(repo, None, "2026-01-02")
    with pytest.raises(release.ReleaseError, match="v0.1.0 exists already"):
        release.release(repo, None, "2026-01-03")
    assert release.git(repo, "tag", "--list") == "v0.1.0"
