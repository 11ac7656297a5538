"""Checksums at the tensor-parallel collectives: is a lock-step mismatch communication or
computation? (`feature.Collectives`, registered in `sdcstudy/features.py`.)"""
