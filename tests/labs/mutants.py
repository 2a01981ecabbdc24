"""Plausible wrong solutions that each lab's graded tests must catch (checked by tests/test_labs.py).

MUTANTS maps a task id to a list of (name, code) pairs. The code replaces that task's whole marked
region in the solution (markers included), written without indentation: it is indented to the
region's level. For every mutant the meta-test grades the solution with that one region replaced and
asserts that the task FAILS; other tasks may pass or fail. Example:

    MUTANTS = {
        "1.2": [
            ("no bias correction", '''
                m_hat, v_hat = exp_avg, exp_avg_sq
                ...
            '''),
        ],
    }
"""

MUTANTS: dict[str, list[tuple[str, str]]] = {}
