"""Fleet pre-admission golden runs: record a reference run on a trusted node, re-run it on a
candidate, compare every bit in program order and say where it first differed.
"""
