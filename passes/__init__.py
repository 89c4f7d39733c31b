"""Built-in passes; importing this package registers them by name (see gcompile.pass_manager)."""

from passes import data_parallel, sequence_parallel, sharded_optimizer, tensor_parallel  # noqa: F401
