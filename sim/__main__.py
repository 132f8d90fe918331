"""`python -m bagel.sim run ...` == `bagel-sim run ...`."""

import sys

from bagel.sim.cli import main

sys.exit(main())
