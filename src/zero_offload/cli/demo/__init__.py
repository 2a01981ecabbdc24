"""`zo demo` (`make demo`): the instructor's end-to-end demonstration.

run.py      the parts in order, under torchrun when asked
parts.py    the parts: the arithmetic, stage 0 out of memory, ZeRO-2 + offload, the schedules, the largest model
report.py   the report the parts' results make
"""
