"""The built-in graph passes; importing this package registers them by name."""

from passes import pipeline_split  # noqa: F401
