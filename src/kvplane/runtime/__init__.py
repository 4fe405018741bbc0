"""Runtime (L7): workers, router, demo, bench and report commands."""
