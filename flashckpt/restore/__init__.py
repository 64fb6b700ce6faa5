"""The restore path: choosing the step and source every rank agrees on, reading stored bytes
back verified into a live state (resharded where the layout changed), and exporting a step.

May import ``flashckpt.snapshot``, ``flashckpt.format`` and the shared ground."""
