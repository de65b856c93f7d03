"""``python -m controlplane`` is the ``controlplane`` command."""

import sys

from controlplane.cli.main import main

sys.exit(main())
