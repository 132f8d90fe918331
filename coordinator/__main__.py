"""`python -m bagel.coordinator ...` runs the `bagel-coordinator` command line."""

import sys

from bagel.coordinator.cli import main

sys.exit(main())
