"""How a flow is described: batches and their columns, the ``Model`` base and ``@step``, the
placeholders a flow is traced with, loops, the graph, and the per-sample random streams."""
