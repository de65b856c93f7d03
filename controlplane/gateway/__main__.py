"""``python -m controlplane.gateway``: one gateway process (see :mod:`controlplane.gateway.process`)."""

import sys

from controlplane.gateway.process import main

sys.exit(main())
