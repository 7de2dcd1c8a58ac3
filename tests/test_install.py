"""torch as the user installed it: the supported range (one line where it is not met, before any
torch code runs), `hethub --version` naming torch's build, and one range in the three places that
state it: pyproject.toml, the run-time check and CI's pin."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from hethub import __version__
from hethub.cli import main
from hethub.errors import HethubError
from hethub.runtime.torch_support import SUPPORTED, check_torch_version, describe_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu130", "2.14.0+rocm7.2", "2.15.0a0+git1a2b3c4"]
)
def test_a_supported_torch_passes(version):
    check_torch_version(version)


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("2.12.0+cu126", "it calls APIs new in 2.13"),
        ("1.13.1", "it calls APIs new in 2.13"),
        ("3.0.0", "a new major version may change the APIs it calls"),
    ],
)
def test_an_unsupported_torch_is_one_line_naming_version_range_and_fix(version, why):
    with pytest.raises(HethubError) as raised:
        check_torch_version(version)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"torch {version} is installed, hethub supports torch >=2.13,<3")
    assert f"({why})" in message
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in message


def test_an_unreadable_version_is_said_not_crashed_on():
    with pytest.raises(HethubError, match="cannot read the installed torch's version 'nightly'"):
        check_torch_version("nightly")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "torch 2.13.0+cpu, CPU build"),
        ({"cuda": "13.0"}, "torch 2.13.0+cpu, CUDA 13.0 build"),
        ({"hip": "7.2.26015-fc0010cf6a"}, "torch 2.13.0+cpu, ROCm 7.2 build"),
        ({"xpu": "20250101"}, "torch 2.13.0+cpu, Intel XPU build"),
        ({"npu": "2.13.0"}, "torch 2.13.0+cpu, CPU build, with torch_npu 2.13.0 for Ascend NPUs"),
    ],
)
def test_the_build_is_named_by_its_accelerator(fields, expected):
    assert describe_build("2.13.0+cpu", **fields) == expected


def hethub(*args: str, before: str = "") -> subprocess.CompletedProcess:
    """`hethub ARGS` in a fresh interpreter, after the Python statements ``before``."""
    code = f"{before}\nfrom hethub.cli import main\nraise SystemExit(main({list(args)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )


def test_version_names_hethub_and_the_installed_torch_build():
    out = hethub("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"hethub {__version__} (torch {torch.__version__}, ")
    if torch.version.cuda is None and torch.version.hip is None:  # this machine's, and CI's
        assert out.stdout == f"hethub {__version__} (torch {torch.__version__}, CPU build)\n"


def test_version_says_so_when_torch_is_not_installed():
    out = hethub("--version", before="import sys; sys.modules['torch'] = None")
    assert (out.returncode, out.stdout) == (0, f"hethub {__version__} (torch not installed)\n")


TORCH_COMMANDS = [
    ["train"],
    ["validate", "--cluster", "c.yaml", "--plan", "p.yaml"],
    ["profile", "--model", "tiny-llama"],
]


@pytest.mark.parametrize("args", TORCH_COMMANDS, ids=" ".join)
def test_the_torch_commands_refuse_an_unsupported_torch_in_one_line(args, capsys, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.12.0+cpu")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hethub {args[0]}: error: torch 2.12.0+cpu is installed, ")
    assert err.count("\n") == 1


def test_a_worker_refuses_an_unsupported_torch_in_one_line(tmp_path):
    """A worker, as hethub train's torchrun starts it (python -m hethub.runtime.worker RUN)."""
    code = (
        "import torch; torch.__version__ = '2.12.0+cpu'; "
        f"from hethub.runtime.worker import main; main([{str(tmp_path)!r}])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("hethub train: error: torch 2.12.0+cpu is installed, ")
    assert out.stderr.count("\n") == 1


def test_the_torch_commands_refuse_a_missing_torch_in_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hethub train: error: torch is not installed, hethub supports torch ")
    assert err.count("\n") == 1


def test_the_commands_without_torch_do_not_check_it(capsys, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.12.0+cpu")
    assert main(["catalog"]) == 0


def test_pyproject_ci_and_the_check_name_one_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirement = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_requirement == [f"torch{SUPPORTED}"]
    pins = [
        line
        for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert pins == ["torch==2.13.0"]
    check_torch_version(pins[0].split("==")[1])  # CI tests a torch inside the range
    assert "-c .ci/constraints.txt" in (ROOT / ".ci" / "run").read_text()
