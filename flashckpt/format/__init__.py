"""What is stored and how it is read back: manifests, the slot and tier layouts, lineage,
checksums and framework pointer files, shared by trainers, the agent and the command line.

May import only the shared ground (``flashckpt.config``, ``errors``, ``safe_paths``...) and
``flashckpt.storage_tiers``."""
