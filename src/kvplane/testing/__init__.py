"""Test harnesses: fault injection, simulated links, peer processes, private servers, clusters.

Imported by tests and benches only, never by a production module (the layering test checks).
"""
