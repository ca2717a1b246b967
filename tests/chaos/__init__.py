"""Chaos tests: kill parts of the real stack while simulated volunteers train, then check the books."""
