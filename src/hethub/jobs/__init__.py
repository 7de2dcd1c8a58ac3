"""A training job before any process starts: its inputs checked, a plan made where none is given,
its prediction, this machine's pre-flight check, and its run directory (prepare); what `hethub
train` and `hethub validate` launch."""

from hethub.jobs.prepare import NO_BF16_KERNELS, Job, plan_devices, planned_precision, prepare

__all__ = ["NO_BF16_KERNELS", "Job", "plan_devices", "planned_precision", "prepare"]
