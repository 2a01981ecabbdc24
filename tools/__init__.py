"""Maintenance tools of the repository, run from its root: ``python -m tools.gpu_check``, ``make site`` and the
like (the Makefile has a target for each). A regular package, so that ``tools`` here is found before any other
installed module of that name."""
