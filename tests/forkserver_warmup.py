"""Imported last by tests/harness.py's fork server, once per test session, before it forks any
worker: what every worker would otherwise redo.

- gpt/'s synthetic token stream, the same in every run (a fifth of a second to draw, a sixth of a
  tiny run): drawn here into gpt.data's cache, which harness._main_worker hands to gpt/train.py as
  its `data` (the same file: the server imported it as part of the gpt package).
- The objects allocated so far, torch's modules mostly, frozen (gc.freeze): the collections that
  train.py runs before its first step and every GC_EVERY steps skip them in each worker.
"""
import gc

import gpt.data

gpt.data.synthetic_stream()
gc.freeze()
