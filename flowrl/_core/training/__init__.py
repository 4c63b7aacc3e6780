"""The training loop's pure logic: episode sampling and the relay buffer, the staleness bound,
random generators as checkpoint state and the safe checkpoint encoding."""
