"""Run ``lmcache-mp bench`` from a source checkout: ``python scripts/bench.py``.

Takes the same options as ``lmcache-mp bench`` (``--help`` lists them).
"""

from __future__ import annotations

import sys

from lmcache_mp.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
