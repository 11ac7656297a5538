"""GPU acceptance: `sdcstudy accept-gpu` runs sdcstudy's commands on one NVIDIA GPU and holds
what they measure to the project's targets (docs/gpu.md). `acceptance` parses the command and
orders the checks, `checks` runs each in a child process (`session`), `floors` judges the
figures, `nvidia_smi` reads the device's state, `torch_step` is the transformers + torch
contender. Nothing here imports JAX in the acceptance's own process.
"""
