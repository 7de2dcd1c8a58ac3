"""The unified communicator: one interface for point-to-point and collectives, whatever the
devices, counting the bytes each moves."""

from hethub.comm.backends import device_backend, local_device, native_backend, peak_memory_bytes
from hethub.comm.communicator import BRIDGE, NATIVE, Communicator, Pending, Work
from hethub.comm.group import Group

__all__ = [
    "BRIDGE",
    "NATIVE",
    "Communicator",
    "Group",
    "Pending",
    "Work",
    "device_backend",
    "local_device",
    "native_backend",
    "peak_memory_bytes",
]
