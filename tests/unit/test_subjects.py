"""The commit-subject check (.ci/subjects, run by .ci/run and by the commit-msg hook in
.ci/hooks): at most 72 characters, ``area: what changed``; comment lines are not the subject."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def verdict(tmp_path: Path, message: str) -> tuple[int, str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run(["bash", str(ROOT / ".ci" / "hooks" / "commit-msg"), str(path)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    return done.returncode, done.stderr


@pytest.mark.parametrize("message", [
    "api: the deadline does not count a worker's planning\n\nWhy, figures, commands.\n",
    "# a comment git strips\nstores, dp: one change in two areas\n",
    "x" * 3 + ": " + "y" * 67 + "\n",  # 72 exactly
])
def test_a_subject_that_reads_as_a_log_passes(tmp_path: Path, message: str) -> None:
    assert verdict(tmp_path, message) == (0, "")


@pytest.mark.parametrize(("message", "said"), [
    ("api: " + "a" * 68 + "\n", "73 characters"),
    ("Fix the thing\n", "not 'area: what changed'"),
    ("api:no space\n", "not 'area: what changed'"),
    ("\nbody without a subject\n", "not 'area: what changed'"),
])
def test_a_subject_that_does_not_is_refused(tmp_path: Path, message: str, said: str) -> None:
    code, err = verdict(tmp_path, message)
    assert code == 1 and said in err and "the body" in err


def test_the_history_since_the_base_reads_as_a_log() -> None:
    """What .ci/run checks: every commit after .ci/history-base (a clone with its history)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to read")
    done = subprocess.run(["bash", str(ROOT / ".ci" / "subjects")], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
