"""The pipeline wing: the runtime of a flow, as components composed by ``AsyncPipeline``.

Pools and their slots, the ledger and the join by sample id, admission and runs, recovery,
resizing (the resizer) and the autoscaler, the progress view, and opening/closing a pipeline. Imports
``_backends`` (by protocol) and ``_core``.
"""
