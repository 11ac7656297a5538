"""Fault injection: what a fault is (specs and profiles modelled on published measurements), the
seeded injector that corrupts named sites inside the jitted step, and its ground-truth log.
"""
