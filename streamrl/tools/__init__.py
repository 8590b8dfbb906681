"""User-facing tools around a run: the command line, replay, reports and metric loggers."""
