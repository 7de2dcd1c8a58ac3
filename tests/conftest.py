"""Settings every test shares."""

import torch

# The single-process references run in the pytest process. torch's default of a thread per core
# makes its thread pool spin against the ranks' processes (and anything else) on a 2-core
# machine: one reference took 12 to 17 s with 2 threads under load, about 1 s with 1. The ranks
# run one thread each too, so the references sum in the same order they do.
torch.set_num_threads(1)
