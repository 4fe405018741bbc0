"""Transports (L2): move bytes between registered regions; see ``base`` for the contract."""
