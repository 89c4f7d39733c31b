"""Built-in passes; importing this package registers them by name (see gcompile.pass_manager)."""

from passes import (context_parallel, data_parallel, expert_parallel, fully_sharded, pipeline_split, sequence_parallel,  # noqa: F401
                    sharded_optimizer, tensor_parallel, tp_comm_overlap)
