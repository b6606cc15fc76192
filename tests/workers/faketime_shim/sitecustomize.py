"""Loaded by the worker processes of ``tests/workers/test_clock_skew.py`` only (this directory
is put first on their PYTHONPATH): a ``time.sleep`` that works under libfaketime 0.9.10.

That release (Debian's and Ubuntu's) rewrites the absolute CLOCK_MONOTONIC deadline that
Python 3.11+ passes to ``clock_nanosleep`` even with DONT_FAKE_MONOTONIC set, so the kernel gets
a negative time and every ``time.sleep`` raises EINVAL (wolfcw/libfaketime#426, fixed in later
releases). ``select`` with a relative timeout is left alone by libfaketime (no speed-up is set),
and is what ``time.sleep`` was before 3.11.
"""

from __future__ import annotations

import select
import time

_real_sleep = time.sleep


def _sleep(seconds: float) -> None:
    if seconds < 0:
        _real_sleep(seconds)  # the same ValueError as ever
    deadline = time.monotonic() + seconds  # monotonic: not faked
    while (left := deadline - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
