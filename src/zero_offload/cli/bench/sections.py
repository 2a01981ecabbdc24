"""The sections of `zo bench`, in the order `run_bench` runs them.

Named in a file of their own that imports nothing, so that `zo`'s parser offers them (`zo bench --only`) without
importing torch, and run.py checks against the same names.
"""

SECTIONS = ("adam", "update", "states", "overhead", "model", "torch-op", "module5")
