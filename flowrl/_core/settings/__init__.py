"""The settings: a model's and a pipeline's (``config``), a run's in sections (``run_config``), and
the bounded reading of run files with their overrides (``config_files``)."""
