"""hethub: train large language models on clusters that mix accelerator kinds.

A predictor and a planner in pure Python (no torch), and a runtime on torch.distributed that
trains what a plan says. The packages are floors, each importing only from those below it: the
README's Layout lists them. `hethub --version` names this version and the torch it runs on.
"""

__version__ = "0.1.0"
