"""``python -m controlplane`` is the ``controlplane`` command."""

import sys

from controlplane.cli import main

sys.exit(main())
