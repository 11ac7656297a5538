"""A healthy and a suspect node trained side by side: lock-step computation synchronization
(RQ1), parameter synchronization (RQ2) and free running (RQ3).
"""
