"""Algorithm-based fault tolerance: checksummed matrix multiplications as a hook on the linear
layers, and its tables on the host.
"""
