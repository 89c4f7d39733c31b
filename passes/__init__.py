"""Built-in passes; importing this package registers them by name (gcompile.pass_manager)."""

from passes import data_parallel, sharded_optimizer  # noqa: F401
