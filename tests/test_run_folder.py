"""A run folder that cannot be written is refused first: before minutes of profiling, in one
line, whatever the user's rights (CI runs as root, whom chmod does not stop).

`hethub train` runs in-process (hethub.cli.main) with profiling and the launch replaced by a
failure: a test that reached either would have measured or started torchrun.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hethub.cli.train
import hethub.profiler.ensure
from hethub.cli import main

UNWRITABLE_FOLDER = "/proc/1"
"""A folder in which no one may create a file, root included (procfs refuses it, and os.access
says so): the stand-in for a folder of another user, or on a read-only file system."""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Run in tmp_path, and fail a test whose command would measure or start a process."""

    def measuring(*args, **kwargs):
        pytest.fail("profiling started before the run folder was checked")

    def launching(*args, **kwargs):
        pytest.fail("a process was started (torchrun)")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hethub.profiler.ensure, "ensure_profiles", measuring)
    monkeypatch.setattr(hethub.cli.train, "launch", launching)
    return tmp_path


@pytest.mark.parametrize("flag", ["--run-dir", "--resume"])
def test_a_run_folder_that_cannot_be_written_is_refused_before_profiling(here, capsys, flag):
    assert Path(UNWRITABLE_FOLDER).is_dir() and not os.access(UNWRITABLE_FOLDER, os.W_OK)
    capsys.readouterr()
    code = main(["train", flag, UNWRITABLE_FOLDER, "--profiles", "profiles"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    refusal = (
        f"hethub train: error: {flag} = {UNWRITABLE_FOLDER!r}: is a folder this user cannot "
        f"write in; give another"
    )
    assert err.splitlines() == [refusal]
    assert not Path("profiles").exists() and not Path("runs").exists()
