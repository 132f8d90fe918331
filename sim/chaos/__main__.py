"""`python -m bagel.sim.chaos SCENARIO --out DIR` == `bagel-sim chaos SCENARIO --out DIR`."""

import sys

from bagel.sim.chaos.command import main

sys.exit(main())
