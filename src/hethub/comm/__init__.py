"""The unified communicator: one interface for point-to-point and collectives whatever the devices."""

from hethub.comm.backends import native_backend
from hethub.comm.communicator import BRIDGE, NATIVE, Communicator

__all__ = ["BRIDGE", "NATIVE", "Communicator", "native_backend"]
