"""The PD pipeline (L6): joins the PD protocol to plans and transports.

Slicing, lookahead slice planning, the slice driver and its completion watcher, the request
timeline, its trace export and the PD metrics. It must not import serving or apps.
"""
