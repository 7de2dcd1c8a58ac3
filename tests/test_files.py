"""hethub.files.write_atomic: the one way run directories and profiles are written."""

from __future__ import annotations

import stat
import subprocess
import sys

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


WRITE_A_RUN_FOLDER = """
from hethub.cli import build_parser
from hethub.jobs import prepare

args = build_parser().parse_args(
    ["train", "--cluster", "cluster.yaml", "--plan", "plan.yaml", "--run-dir", "run"]
)
prepare(args, measure=False, local_launch=False)  # an H100 cluster: priced, nothing measured
"""
CLUSTER = "groups: [{name: nv, accelerator: h100, nodes: 1, devices_per_node: 2}]\n"
PLAN = """model: tiny-llama
global_batch: 4
micro_batch: 1
pipelines:
  - stages: [{group: nv, tp: 1, layers: 5}, {group: nv, tp: 1, layers: 3}]
"""


def test_a_run_folder_is_written_with_the_user_s_umask(tmp_path):
    # A teammate on the shared file system reads the run as its owner does: mkstemp's 0600
    # would keep them out. 027, not the usual 022: the mode follows the umask, not a constant.
    umask, mode = 0o027, 0o640
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN)
    done = subprocess.run(
        [sys.executable, "-c", WRITE_A_RUN_FOLDER],
        cwd=tmp_path,
        umask=umask,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    written = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run.iterdir() if p.is_file()}
    assert {"cluster.yaml", "plan.yaml", "run.json", "prediction.json"} <= written.keys()
    assert written == dict.fromkeys(written, mode)


WRITE_BOTH_WAYS = """
import sys
from pathlib import Path
from hethub.files import write_atomic

folder = Path(sys.argv[1])
write_atomic(folder / "profile.json", "{}")
(folder / "opened.json").write_text("{}")
"""


def test_write_atomic_gives_the_mode_open_gives(tmp_path):
    # Every writer of a run folder and of profiles (profiles.files.save_profile) goes through
    # write_atomic. In a child process: the umask is the whole process's.
    for umask in (0o022, 0o027, 0o077):
        folder = tmp_path / f"umask-{umask:o}"
        folder.mkdir()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                WRITE_BOTH_WAYS,
                str(folder),
            ],
            umask=umask,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        atomic, opened = (
            stat.S_IMODE((folder / n).stat().st_mode) for n in ("profile.json", "opened.json")
        )
        assert atomic == opened == 0o666 & ~umask
