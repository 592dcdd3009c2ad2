"""expertd, the expert-storage daemon: owns experts.pack, its O_DIRECT readers and the shared pinned
staging, and serves FETCH requests over ZeroMQ. Reads the pack through expertpack.packtools' layout."""
