"""Pure-torch oracles. Every kernel and fast path is tested against these."""
