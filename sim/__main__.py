"""`python -m bagel.sim run ...` == `bagel-sim run ...`."""

import sys

from .cli import main

sys.exit(main())
