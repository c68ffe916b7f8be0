"""Rich renderings of the engine's events: live view, block map, tables, charts, inspect."""
