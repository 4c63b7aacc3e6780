"""What a run tells: the pipeline's stats and their recorder, spans and the Chrome trace."""
