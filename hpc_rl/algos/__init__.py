"""The algorithms: registry.py (what each needs; no torch), estimators.py (advantages), advantages.py,
losses.py, kl.py, utils.py: pure tensor functions, each with its formula and source."""
