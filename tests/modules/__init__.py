"""The course modules' sources: basics, ZeRO and stage 3, offload, tuning, the pipeline and NVMe."""
