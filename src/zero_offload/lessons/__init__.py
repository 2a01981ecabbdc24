"""Measurement helpers the lesson notebooks call (lessons/0*_*.py).

A notebook shows the configuration it measures, the call, the printed table or plot and what to read from it;
the loops that time, interleave and collect live here, one module per lesson or per experiment:

    tuning_kernel     lesson 4, sections 1-2: the roofline sweep, the raw C call, correctness and rounding checks
    tuning_threads    lesson 4, section 4: threads against memory bandwidth, per-call cost, sharing cores with torch
    tuning_partial    lesson 4, sections 5-7: partial offload runs, the calibrated model against them, the advice
    tuning_plots      lesson 4's figures
    practice_steps    lesson 5, sections 1-3: module 5's configuration, one step zoomed in, bit-identity runs
    practice_dpu      lesson 5, section 4: the cost of a one-step-stale gradient, and a plain-torch reference
    practice_nvme     lesson 5, section 5: the NVMe tier against the CPU tier, and a full disk
    practice_runs     lesson 5, sections 6-7: the largest model on a V100, `zo train`, two nodes, a killed rank

Nothing here is part of the engine: the helpers only drive it. Every function takes what it measures (sizes,
rounds, the corpus) as arguments; smoke mode (ZO_SMOKE=1) is the notebook's choice of smaller arguments.
"""
