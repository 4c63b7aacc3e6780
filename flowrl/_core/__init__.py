"""The core wing: flowrl's vocabulary and its pure logic, grouped by purpose.

At the root, what every group uses: the ``FlowError`` tree (``errors``), the argument checks of
the public entry points (``checks``) and the model-name rule (``names``). Then ``settings``
(configs and run files), ``flow`` (batches, models, tracing, the graph), ``scheduling`` (the
splitters, the pull scheduler, autoscaling), ``training`` (episodes, staleness, checkpoint
state) and ``observe`` (stats, traces). No event loop, no Ray, no I/O beyond files a caller
names: everything here is tested with plain function calls. Imports nothing from the other wings.
"""
