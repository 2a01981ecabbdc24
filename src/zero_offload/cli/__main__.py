"""`python -m zero_offload.cli ...` (and `torchrun ... -m zero_offload.cli ...`): the `zo` command."""

import sys

from .main import main

sys.exit(main())
