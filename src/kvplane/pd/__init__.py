"""PD control protocol (L6): one sans-IO protocol for every transport.

Sessions, tables, ledger and participant do no I/O; only ``endpoint`` touches sockets. See
docs/pd.md.
"""
