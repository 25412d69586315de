"""Planning: who writes which chunk (save) and which bytes each rank reads (load)."""
