"""The engine: block accounting, scheduling and model execution. Knows nothing of Typer or Rich."""
