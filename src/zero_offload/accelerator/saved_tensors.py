"""Activations on the emulated device: what autograd saves for backward is charged to the budget until freed."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

import torch


class ChargeSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Charge what autograd saves for backward, as the device would hold it, until backward frees it.

    A fp32 activation is charged at the storage precision (2 bytes in an fp16 run): a GPU computing in fp16
    would hold it in fp16; the emulated device computes in fp32 only because the CPU is slow at fp16.
    Parameters, gradients and the fp32 compute copies of the weights are not charged again.

    The emulated device hands in its books: the storages it already charges (`on_device`), the fp32 compute
    copies by storage with the weight each came from (`compute_copies`), and how to charge and release bytes.
    """

    def __init__(
        self,
        storage_dtype: torch.dtype,
        *,
        on_device: Container[int],
        compute_copies: Mapping[int, torch.Tensor | None],
        charge: Callable[[int, str], None],
        release: Callable[[int, str], None],
    ):
        self.on_device, self.compute_copies = on_device, compute_copies
        self.charge, self.release = charge, release
        self.shrink = storage_dtype.itemsize / 4 if storage_dtype != torch.float32 else 1.0
        self.live: dict[int, list] = {}  # storage data_ptr -> [handle count, bytes charged]
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        source = self.compute_copies.get(key)
        if source is not None and source.is_contiguous():
            # Upcast again in backward: keeping every layer's fp32 copy from forward to backward would hold
            # the whole model in fp32 at once, memory a GPU computing in fp16 never needs. Autograd often
            # saves a view of the copy (the transposed weight of a matmul): its layout is kept too.
            return _Upcast(source, tensor)
        if key in self.on_device or key in self.compute_copies:
            return tensor
        if key not in self.live:
            nbytes = tensor.untyped_storage().nbytes()
            if tensor.dtype == torch.float32:
                nbytes = int(nbytes * self.shrink)
            self.charge(nbytes, "activations")
            self.live[key] = [0, nbytes]
        self.live[key][0] += 1
        # Detached: a handle that held the tensor itself would close a reference cycle through autograd's graph
        # that Python's collector cannot see, and a forward without backward would never give its bytes back.
        return _SavedHandle(self, key, tensor.detach())

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _Upcast):
            return packed.source.to(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
        return packed.tensor if isinstance(packed, _SavedHandle) else packed

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.release(entry[1], "activations")


class _Upcast:
    """A saved fp32 compute copy, kept as the low-precision weight it came from."""

    __slots__ = ("source", "dtype", "size", "stride", "offset")

    def __init__(self, source: torch.Tensor, saved: torch.Tensor):
        self.source, self.dtype = source, saved.dtype
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()


class _SavedHandle:
    """What autograd keeps for one saved tensor; its death is when the device would free the activation."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: ChargeSavedTensors, key: int, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner._drop(self.key)
