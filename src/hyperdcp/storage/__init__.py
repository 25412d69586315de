"""Storage: bytes to and from data files, checksums, and the crash-consistent commit."""
