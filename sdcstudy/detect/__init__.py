"""SDC detectors side by side on the same faults (`experiment.mode: detect`): the executions each
detector needs, the host-side monitor, rollback, and the detector tables.
"""
