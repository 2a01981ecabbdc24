"""Module 2 (principles 原理篇): ZeRO stages 1, 2 and 3 over torch.distributed, and activation recomputation.

zero.py             the model states of data-parallel training, each partitioned over the ranks
device_buffers.py   where those states live when none leaves the device (module 3 places them on the host)
partition.py        parameters flattened into contiguous buffers, each cut into world-size shards
buckets.py          gradients leave the device in large pieces while backward still runs
comm.py             the collectives ZeRO needs, with every element they move counted
process_group.py    joining the process group torchrun describes
stage3_gather.py    stage 3's weights gathered just before use, released right after, prefetched (a part
                    the states own: states.gathering)
stage3_params.py    stage 3's parameters wherever a program reads them
stage3_leaves.py    stage 3's leaf modules, and what it says when the ranks' passes part ways
recompute.py        activation recomputation: each block's input kept, the rest recomputed in backward
"""
