"""`python -m crossover.loadtest.proxybench ...`: the proxy benchmark (see harness.py)."""

import sys

from crossover.loadtest.proxybench.harness import main

sys.exit(main())
