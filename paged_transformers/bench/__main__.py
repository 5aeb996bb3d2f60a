"""``python -m paged_transformers.bench``: the same as ``paged-transformers bench``."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
