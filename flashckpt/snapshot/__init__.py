"""The save path: a live state flattened into a layout (the walk compiled once it is steady),
copied in batches (from CPU or through pinned memory from a device) into a rank's
shared-memory slots, sealed with checksums and published.

May import ``flashckpt.format`` and the shared ground."""
