"""`python -m trl.cli`: same as the `trl` command."""

import sys

from .main import main


sys.exit(main())
