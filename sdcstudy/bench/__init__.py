"""`sdcstudy bench`: performance benchmarks, each suite timed side by side in one run.
"""
