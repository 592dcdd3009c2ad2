"""Where a step's experts come from when they are not all resident: the VRAM expert cache and its
eviction policy, the connection to expertd, prefetch and lookahead, the split of sources over
several devices, and routing traces. Nothing here decides what is computed."""
