"""`sdcstudy plan CONFIG`: a setup's per-device memory, FLOPs, node-crossing bytes and step time,
from its step compiled ahead of time, before anyone books the devices (docs/plan.md).

`devices` (named devices, peaks, the measured MFU), `aot` (the step compiled from abstract
values), `crossing` (bytes between the nodes), `summary` (the plan's numbers), `text` (how they
print), `cli` (the command).
"""
