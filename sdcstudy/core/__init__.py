"""The foundation: configuration, the model and its named sites, data, the training step and
host loop pieces, checkpoints, meshes, determinism, digests, run folders and metrics.

Nothing here imports a feature subpackage; features compose their hooks into the step from
outside (see docs/architecture.md).
"""
