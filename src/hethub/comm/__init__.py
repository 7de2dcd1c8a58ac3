"""The unified communicator: one interface for point-to-point and collectives, whatever the
devices, counting the bytes each moves."""

from hethub.comm.backends import device_backend, local_device, native_backend, peak_memory_bytes
from hethub.comm.communicator import (
    BRIDGE,
    BRIDGE_CHUNK_BYTES,
    NATIVE,
    Communicator,
    Pending,
    SlicedSum,
    Work,
)
from hethub.comm.group import Group, SlicedBridge
from hethub.comm.staging import StagingPool

__all__ = [
    "BRIDGE",
    "BRIDGE_CHUNK_BYTES",
    "NATIVE",
    "Communicator",
    "Group",
    "Pending",
    "SlicedBridge",
    "SlicedSum",
    "StagingPool",
    "Work",
    "device_backend",
    "local_device",
    "native_backend",
    "peak_memory_bytes",
]
