"""`zo grade N` (`make labN`): grade a lab, and the tools that keep labs/ and solutions/ in step with src/.

labs.py     the labs, their tasks and points (`LABS`)
run.py      the grading run: the package copied, lab N's files swapped in, its tests run
plugin.py   the pytest plugin inside that run, which records each test's outcome
report.py   what the run found, task by task, and the table it prints
labkit.py   the lab markers in src/: labs/ and solutions/ generated from them (`tools/make_labs.py`)
"""
