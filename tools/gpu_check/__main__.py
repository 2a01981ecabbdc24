"""`python -m tools.gpu_check`: runs the checks (see the package's docstring)."""

import sys

from tools.gpu_check import main

sys.exit(main())
