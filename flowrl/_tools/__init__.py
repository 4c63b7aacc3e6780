"""The tools wing: what is built on the library and never imported by it.

The ``flowrl`` command, run files, the load test and its baselines, the timeline view and the
configuration reference generator.
"""
