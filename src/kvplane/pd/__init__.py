"""PD control protocol (L6): one sans-IO protocol for every transport.

``handshake`` (layout wire data, compatibility check), ``events`` (typed wire and local events),
``states`` (the transition tables), ``ledger`` (memory ownership per session and peer),
``timers``, ``actions``, ``session`` / ``sender`` / ``receiver`` (the sans-IO sessions),
``peers`` (handshake verdicts, leases), ``tombstones`` (retired sessions), ``participant``
(one worker's sessions, epochs, timers), ``codec`` (frames), ``endpoint`` (the only module that
touches sockets) and ``diagram`` (Mermaid
from the tables).
"""
