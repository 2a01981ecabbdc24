"""`zo bench` (`make bench`): speed measured as ratios within one run, and the experiments the demo shares.

run.py        every section, in order, into results.json
sections.py   the sections' names (read by `zo`'s parser without importing torch)
adam.py       the Adam kernel; training.py whole training steps; cpu.py the CPU step against the model
timing.py     how: interleaved rounds, medians, a quiet machine
schedules.py  serial, overlapped and delayed steps compared, with busy.py's busy times and bound
largest.py    the largest model that trains under a device budget
"""
