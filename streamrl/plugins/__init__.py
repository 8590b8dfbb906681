"""The functions users plug in by dotted path, and the built-in ones: rewards, filters, datasets
and the synthetic tasks."""
