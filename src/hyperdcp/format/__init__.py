"""The on-disk format v1: metadata (the commit record), plain values, data-file headers."""
