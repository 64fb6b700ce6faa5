"""Detection and recovery: heartbeat pages, the hang watchdog, the launcher (``flashckpt-run``)
and its link to the node agent and controller, in-process recovery with warm standbys, and
the event log with the effective-time report built from it.

May import ``flashckpt.restore``, ``flashckpt.snapshot``, ``flashckpt.format``, the shared
ground, and the agent and controller it starts and talks to."""
