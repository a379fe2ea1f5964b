# A stand-in for nanoGPT's configurator.py (tests/test_vs_nanogpt.py): its train.py parses the overrides itself.
