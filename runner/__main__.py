"""``python -m runner``: run the work item this sandbox was started for."""

import sys

from .identity import protect

if __name__ == "__main__":
    # First of all, before the runner holds a token: non-dumpable, and no token in the
    # environment block (this may re-execute the interpreter). See runner/identity.py.
    protect()
    from .main import main

    sys.exit(main())
