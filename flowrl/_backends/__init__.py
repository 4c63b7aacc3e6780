"""The backends wing: where replicas and trainer ranks run.

``abc`` is the protocol, split by role; ``inprocess`` and ``ray_backend`` implement it (only
``select`` names both); ``replica`` is what runs inside a replica whatever the backend. The Ray
modules here are the only ones in flowrl's library that import ``ray``. Imports ``_core`` only.
"""
