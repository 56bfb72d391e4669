"""`python -m benchmarks.gpu`: the one entry point of the GPU checks (`make gpu-check`, `make gpu-quick`; check.py)."""

import sys

from .check import main

sys.exit(main())
