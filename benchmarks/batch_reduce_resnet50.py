#!/usr/bin/env python
"""``batch_reduce`` on ResNet-50's gradients, now ``mpistrat bench --batch resnet50``: this
script forwards its arguments to it.

These two commands are the same::

    python -m mpistrat.launch -n 2 -- python benchmarks/batch_reduce_resnet50.py --num-packs 1,2,4
    mpistrat bench --np 2 --batch resnet50 --num-packs 1,2,4

Options and method: ``mpistrat bench --help`` and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys

from mpistrat.cli import main

if __name__ == "__main__":
    main(["bench", "--batch", "resnet50", *sys.argv[1:]], prog_name="batch_reduce_resnet50.py")
