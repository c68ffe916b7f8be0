"""The engine's books and loop: blocks, the pool, scheduling, events, steps."""
