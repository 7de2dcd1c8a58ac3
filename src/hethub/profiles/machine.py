"""Which machine this is, and where its profiles are kept.

Pure Python (no torch): the predictor's commands name the default folder in their help. Profiles
hold one machine's times, so they are kept per machine in the user's cache folder,
``$XDG_CACHE_HOME/hethub/profiles/<machine>`` (``~/.cache`` without it), where ``<machine>`` is
this host's name and a short digest of its name and CPU model: a home folder shared by many hosts
keeps each host's apart, and a host name reused on other hardware gets a folder of its own.
``HETHUB_PROFILES`` names another folder, and each command's --profiles (--out) overrides both.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import socket
from functools import cache
from pathlib import Path

PROFILES_ENV = "HETHUB_PROFILES"
"""The environment variable that names the profile folder in place of the cache's."""
_CPUINFO = Path("/proc/cpuinfo")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def host_name() -> str:
    """This host's name as the network knows it (socket.gethostname)."""
    return socket.gethostname() or "unknown-host"


@cache
def cpu_model() -> str:
    """The CPU's model: /proc/cpuinfo's first "model name" on Linux, else what the platform says
    (platform.processor, empty on many systems; then the architecture)."""
    try:
        for line in _CPUINFO.read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def torch_version() -> str | None:
    """The installed torch's version, read without importing torch (None: not installed)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_average() -> float | None:
    """The 1-minute load average: runnable processes, averaged (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_key() -> str:
    """A short, stable name of this machine: its host name and 8 hex digits of a digest of the
    host name and CPU model."""
    host = host_name()
    digest = hashlib.sha256(f"{host}\n{cpu_model()}".encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('_', host.split('.')[0])[:40]}-{digest}"


def default_profiles_dir() -> Path:
    """Where the commands keep this machine's profiles unless told (--profiles, --out):
    $HETHUB_PROFILES, else the user's cache folder's hethub/profiles/<machine_key()>."""
    given = os.environ.get(PROFILES_ENV)
    if given:
        return Path(given).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME")
    # The XDG rule: a relative XDG_CACHE_HOME is invalid and ignored.
    base = Path(cache_home) if cache_home and Path(cache_home).is_absolute() else None
    return (base or Path.home() / ".cache") / "hethub" / "profiles" / machine_key()
