"""`python -m bagel.worker join ...` (and `torchrun ... -m bagel.worker join ...`)."""

import sys

from bagel.worker.cli import main

sys.exit(main())
