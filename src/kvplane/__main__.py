"""``python -m kvplane`` runs the CLI."""

import sys

from kvplane.cli import main

sys.exit(main())
