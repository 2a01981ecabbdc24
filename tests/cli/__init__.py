"""The commands: `zo train`, plan, bench and demo, the launcher and its rendezvous, the GPU check."""
