"""The benchmarks' tests import their modules (``side_by_side``, ``watch``) as the benchmarks
do: from the bench/ directory."""

from __future__ import annotations

import sys

from tests.bench.smoke import BENCH

if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
