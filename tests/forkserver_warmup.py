"""Imported last by tests/harness.py's fork server, once per test session, before it forks any
worker: what every worker would otherwise redo.

- The server's own sys.path, which Python 3.11's fork server does not take from the test process
  (only the workers get it): the repository's root and tests/, so that what the server preloads is
  what the workers would import (the `workers` module among them).
- gpt/'s synthetic token stream, the same in every run (a fifth of a second to draw, a sixth of a
  tiny run): drawn here into gpt.data's cache, which harness._main_worker hands to gpt/train.py as
  its `data` (the same file: the server imported it as part of the gpt package).
- The objects allocated so far, torch's modules mostly, frozen (gc.freeze): the collections that
  train.py runs before its first step and every GC_EVERY steps skip them in each worker.

tests/test_gpt.py checks that a worker sees all three.
"""
import gc
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(TESTS.parent), str(TESTS)) if p not in sys.path]

import workers  # noqa: E402, F401

import gpt.data  # noqa: E402

gpt.data.synthetic_stream()
gc.freeze()
