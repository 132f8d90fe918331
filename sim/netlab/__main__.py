"""`python -m bagel.sim.netlab up | down | status | shape | partition | heal`."""

import sys

from bagel.sim.netlab.command import main

sys.exit(main())
