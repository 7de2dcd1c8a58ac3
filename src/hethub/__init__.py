"""hethub: train large language models on clusters that mix accelerator kinds.

The packages follow the flow of a job:
  spec/       typed, validated inputs (cluster, model, plan) and the accelerator catalog
  predictor/  iteration time, throughput and memory of a plan, without torch
  report/     tables and Chrome traces for people
"""

__version__ = "0.1.0"
