"""KV producers and decoders of the PD workers: the protocol (``base``), a real model, synthetic."""
