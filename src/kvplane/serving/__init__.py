"""Serving (L7): prefill and decode workers, their KV pools, prefix offload, order sockets.

``producers/`` holds what computes and consumes KV (the ``KVProducer`` plug-in point);
``router/`` pairs workers and carries requests. It must not import apps or testing.
"""
