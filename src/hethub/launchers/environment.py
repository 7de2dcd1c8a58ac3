"""Each group's interpreter and environment variables in what `hethub launch` writes: its vendor's
defaults (hethub/data/vendor_env.yaml), then the group's own ``launch:`` section. Every vendor's
torch build lives in its own environment, so a group's nodes start their own Python."""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from importlib import resources
from typing import Any

from hethub.errors import HethubError
from hethub.spec.cluster import DeviceGroup, LaunchSettings
from hethub.spec.fields import parse_yaml

VENDOR_ENV = "vendor_env.yaml"
VENDOR_FIELDS = ("visible_devices", "env", "to_set")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupEnvironment:
    """What a group's nodes start with: their Python and the shell lines of their variables."""

    python: str
    exported: tuple[tuple[str, str], ...]
    """Variables exported as they are, the vendor's then the group's, each name once."""
    visible_devices: tuple[str, str] | None
    """The vendor's device visibility variable and the value it takes where no scheduler or
    device plugin set it: every device of the node."""
    to_set: tuple[tuple[str, str], ...]
    """Variables left to the admin (network interfaces): name, and what to give."""

    def lines(self) -> list[str]:
        """The shell lines: the exports, then a comment for each variable left to set."""
        lines = [f"export {name}={shlex.quote(value)}" for name, value in self.exported]
        if self.visible_devices is not None:
            name, every = self.visible_devices
            lines.append(f'export {name}="${{{name}:-{every}}}"')
        lines += [
            f"# export {name}=...  # {what}: set it in the group's launch: env"
            for name, what in self.to_set
        ]
        return lines

    def exports(self) -> str:
        """The exports alone, on one line, each ending in '; ' (for a `bash -c` command)."""
        return "".join(f"{line}; " for line in self.lines() if line.startswith("export "))


@functools.cache
def vendor_environments() -> dict[str, dict[str, Any]]:
    """Each vendor's defaults, and ``all``'s, as hethub/data/vendor_env.yaml gives them."""
    text = resources.files("hethub.data").joinpath(VENDOR_ENV).read_text()
    data = parse_yaml(text, VENDOR_ENV)
    for vendor, fields in data.items():
        unknown = set(fields) - set(VENDOR_FIELDS)
        if unknown:  # the package's own file: a slip in it is hethub's, said plainly
            raise HethubError(f"{VENDOR_ENV}: vendor {vendor}: unknown fields {sorted(unknown)}")
    return data


def group_environment(group: DeviceGroup, python: str) -> GroupEnvironment:
    """A group's environment: ``python`` (the --python flag) unless its launch: names its own;
    the vendor's variables (``all``'s first), each replaced by the group's of the same name, and
    dropped where the group gives it null."""
    own = group.launch or LaunchSettings()
    defaults = vendor_environments()
    common, vendor = defaults.get("all", {}), defaults.get(group.accelerator.vendor, {})
    values: dict[str, str | None] = {
        name: str(value)
        for name, value in {**common.get("env", {}), **vendor.get("env", {})}.items()
    }
    values.update(own.env)
    visible = None
    visible_name = vendor.get("visible_devices")
    if visible_name is not None and visible_name not in values:
        visible = (visible_name, ",".join(map(str, range(group.devices_per_node))))
    to_set = {**common.get("to_set", {}), **vendor.get("to_set", {})}
    return GroupEnvironment(
        python=own.python or python,
        exported=tuple((name, value) for name, value in values.items() if value is not None),
        visible_devices=visible,
        to_set=tuple((name, what) for name, what in to_set.items() if name not in values),
    )
