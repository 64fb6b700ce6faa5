"""See DESIGN: part of flashckpt."""
