"""The router: membership of workers, pairing, request routing and its client service."""
