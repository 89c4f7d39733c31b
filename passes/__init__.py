"""Built-in passes; importing this package registers them by name (see gcompile.pass_manager)."""

from passes import (data_parallel, pipeline_split, sequence_parallel, sharded_optimizer,  # noqa: F401
                    tensor_parallel, tp_comm_overlap)
