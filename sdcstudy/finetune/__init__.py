"""Fine-tuning under SDC (RQ3): multiple-choice QA tasks, the paired fine-tuning step, and
Table 3 / Figure 7 from its run folders.
"""
