"""The session core: what both backends share (sessions, revisions, leases, limits,
tenants, planning of directive batches, the ``/leyline/v1`` routes and error mapping).

It imports no torch: the SGLang plugin's server process and ``make test`` use it as is.
"""
