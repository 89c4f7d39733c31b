"""Built-in graph passes; importing the package registers them by name (see gcompile.pass_manager)."""

from passes import sequence_parallel, tensor_parallel  # noqa: F401
