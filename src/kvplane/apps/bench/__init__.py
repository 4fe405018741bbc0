"""``kvplane bench``: one module per bench, the shared estimators in ``common``."""
