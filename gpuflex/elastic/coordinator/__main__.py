"""`python -m gpuflex.elastic.coordinator`: see main.py."""

import sys

from gpuflex.elastic.coordinator.main import main

sys.exit(main())
