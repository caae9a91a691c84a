"""``python -m runner``: run the work item this sandbox was started for."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
