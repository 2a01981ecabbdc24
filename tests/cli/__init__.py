"""The commands: `zo train`, plan, bench, demo and grade's callers, the launcher, rendezvous, the GPU check."""
