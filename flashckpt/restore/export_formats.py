"""The formats a step is exported to, and the default shard size: what the ``flashckpt`` command
lists in its help, named without loading torch (which only an export itself needs)."""

FORMATS = ("torch", "safetensors", "dcp", "megatron")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", transformers' unit and default
