"""Module 5 (practice 实战篇): the overlapped copy/compute pipeline, the delayed parameter update, the NVMe tier.

  pipeline.py         the overlapped offload step: copies and the CPU's Adam hide behind the device's work
  host_gradients.py   the pipeline's parts that hold the host's gradients: the fp32 partition, DPU's kept areas
  early_uploads.py    its part that sends the delayed update's new weights up during the next backward
  dpu.py              delayed parameter update: the CPU's Adam of step t runs during step t+1
  nvme.py             the NVMe tier: the fp32 optimizer states in files; nvme_files.py, nvme_lock.py its files
  timeline.py         when each stage of a step ran, on each rank; spans.py its stages, timeline_plots.py its pictures
The `zo train` application and the experiments of the demo and the bench that use these are in cli/.
"""
