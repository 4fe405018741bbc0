"""Commands (L8): serve, demo, generate, report and ``bench/``; wiring only."""
