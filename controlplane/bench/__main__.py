"""``python -m controlplane.bench``: the control plane's benchmarks."""

import sys

from controlplane.bench.gateway import main

sys.exit(main())
