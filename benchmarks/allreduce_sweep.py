#!/usr/bin/env python
"""The all-reduce sweep, now ``mpistrat bench``: this script forwards its arguments to it.

These two commands are the same::

    python -m mpistrat.launch -n 2 -- python benchmarks/allreduce_sweep.py -b 4 -e 256M
    mpistrat bench --np 2 -b 4 -e 256M

Options and method: ``mpistrat bench --help`` and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys

from mpistrat.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]], prog_name="allreduce_sweep.py")
