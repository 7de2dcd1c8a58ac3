"""hethub.files.write_atomic: the one way run directories and profiles are written."""

from __future__ import annotations

import pytest

from hethub.files import write_atomic


def test_write_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left


def test_write_atomic_that_fails_keeps_no_temporary_file(tmp_path):
    folder = tmp_path / "taken"
    folder.mkdir()  # a folder cannot be replaced by a file
    with pytest.raises(OSError):
        write_atomic(folder, "text")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and folder.is_dir()
