"""The course modules' sources, one area each: basics, ZeRO and stage 3, offload, tuning, the pipeline and NVMe."""
