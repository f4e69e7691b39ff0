"""``python -m tpflex_cli``: the same as the ``tpflexctl`` console script."""

import sys

from tpflex_cli.main import main

sys.exit(main())
