"""PAFT: data-parallel workers whose gradient aggregation goes wrong (noise, packet loss), and
periodic parameter averaging against it, in `shard_map`.
"""
