"""Studies on a workload: replay's dry-run grids, the fleet what-if, advise."""
