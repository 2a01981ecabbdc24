"""ZeRO-3's parameters wherever a program reads them, not only inside their own module's forward.

At stage 3 a parameter's memory is freed between uses; its unit is gathered by hooks on the module that
registered it (the states' UnitGathering, stage3_gather.py, installs them). Real models read parameters in
other places too, and each must find them present:

- inside another module's forward: `nn.MultiheadAttention` reads `out_proj.weight` without calling `out_proj`.
  Every stage-3 parameter is a `PartitionedParameter`, whose `__torch_function__` sees any torch op that reads
  it; while a forward runs, an op on a freed parameter gathers its unit on the spot. The unit is released when
  the module that was running ends, and the same module's backward gathers it again (autograd saved it).
- in a forward recomputed during backward (activation checkpointing, ours or the model's own): the units it
  gathers stay until their gradients are complete, because the backward that follows reads them.
- outside any forward: `model.state_dict()` (and so `torch.save` or `save_pretrained`) returns full weights,
  gathered one module at a time; `gathered(...)` (`engine.gathered_parameters()`) gathers them for reading or
  editing; any other op on a freed parameter is a Python error that names these, never a read of freed memory.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

# Reading these touches no element, so they need no gather: shapes, dtype, device, autograd's bookkeeping.
_METADATA_METHODS = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__hash__,
    torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
    torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.retain_grad,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.get_device,
}  # fmt: skip
_METADATA_PROPERTIES = {
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "itemsize", "nbytes", "retains_grad",
    "_backward_hooks", "_post_accumulate_grad_hooks", "_version", "output_nr", "_base", "is_mkldnn",
}  # fmt: skip
_DESCRIBE = {torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__}


def _reads_elements(func) -> bool:
    if func in _METADATA_METHODS:
        return False
    if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
        # A property: `p.data = ...` (the engine's own rebinding) and metadata need nothing; `p.data`, `p.T`
        # and the like are views of the elements, and an op on such a view would read freed memory.
        return func.__name__ == "__get__" and func.__self__.__name__ not in _METADATA_PROPERTIES
    return True


def _partitioned(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, PartitionedParameter):
            yield value
        elif isinstance(value, (list, tuple)):  # torch.cat([...]), the _foreach ops
            yield from (v for v in value if isinstance(v, PartitionedParameter))


class PartitionedParameter(torch.nn.Parameter):
    """A stage-3 parameter: every torch op that reads it first makes sure its unit is gathered."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_elements(func):
            for param in _partitioned(args, kwargs):
                unit = param._zo_unit
                # A prefetched unit is marked gathered while its all-gather may still be writing the buffer:
                # reading it is safe only once the collective has landed.
                if not unit.gathered or unit.pending is not None:
                    if func in _DESCRIBE and not unit.gathered:
                        return param._zo_access.describe(param)
                    param._zo_access.gather_on_access(param)
        with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors, as with any Parameter
            return func(*args, **kwargs)


class PartitionedAccessError(RuntimeError):
    """A stage-3 parameter was read outside a forward while only this rank's shard of it exists."""


class ParameterAccess:
    """The hooks and the bookkeeping that let every read of a stage-3 parameter find it gathered."""

    def __init__(self, gathering, model: torch.nn.Module, unit_of: dict[int, tuple[int, int]], leaves=()):
        # gathering: stage3_gather.UnitGathering, which gathers and releases the units these hooks ask for
        self.gathering, self.unit_of = gathering, unit_of
        self.names = {module: name for name, module in model.named_modules()}  # for the errors
        self._running: list[tuple[torch.nn.Module, set[int]]] = []  # forwards in progress, innermost last
        # Units a module's forward gathered on access, by the innermost running module whose hooks gather units
        # (None: no such module); its backward pre-hook gathers them again.
        self._borrowed: dict[torch.nn.Module | None, set[int]] = {}
        self._gathers: dict[torch.nn.Module, list[int]] = {}  # module -> the units its own hooks gather
        self._export = (lambda: None, {})  # (the state_dict being filled, its clones by parameter id)
        self._keep_vars = False
        inside_leaf = {m for leaf in leaves for m in leaf.modules() if m is not leaf}
        for module in model.modules():
            # A leaf gathers its whole subtree (stage3_leaves.py); the modules inside it gather nothing.
            if module in inside_leaf:
                pass
            elif module in leaves:
                self._install(module, self._units_in(module.parameters()))
            else:
                self._install(module, self._own_units(module))
            self._install_export(module)
        for unit in gathering.units:
            for param in unit.params:
                param.__class__ = PartitionedParameter
                param._zo_unit, param._zo_access = unit, self

    def _units_in(self, params) -> list[int]:
        return sorted({self.unit_of[id(p)][0] for p in params if id(p) in self.unit_of})

    def _own_units(self, module: torch.nn.Module) -> list[int]:
        return self._units_in(module.parameters(recurse=False))

    def running_modules(self) -> list[torch.nn.Module]:
        """The modules whose forward is running, outermost first."""
        return [module for module, _ in self._running]

    def _install(self, module: torch.nn.Module, own: list[int]) -> None:
        """The hooks that gather `own` (units) around `module`'s forward and backward."""
        gathering = self.gathering
        self._gathers[module] = own

        def enter(*_):
            self._running.append((module, set()))
            for index in own:
                gathering.gather(index)

        def leave(*_):
            _, borrowed = self._running.pop()
            if gathering.in_backward:
                return  # a forward recomputed in backward: its backward comes next and reads these units
            for index in (*own, *borrowed):
                gathering.release(index)

        def gather_for_backward(*_):
            for index in (*own, *self._borrowed.get(module, ())):
                gathering.gather(index)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        if own:  # full backward hooks wrap the module's outputs: only where there is something to gather
            module.register_full_backward_pre_hook(gather_for_backward)

    def _install_export(self, module: torch.nn.Module) -> None:
        """state_dict() of `module` exports its own parameters' full weights (a leaf's children too)."""
        if self._own_units(module):
            module.register_state_dict_pre_hook(self._before_export)
            module._register_state_dict_hook(self._export_module)

    # -- reads inside and outside a forward ------------------------------------------------------------------
    def gather_on_access(self, param: PartitionedParameter) -> None:
        index = self.unit_of[id(param)][0]
        if not self._running:
            raise PartitionedAccessError(
                f"this parameter (shape {list(param.shape)}) is partitioned by ZeRO stage 3: this rank holds "
                "only its shard between forwards. Read or edit it inside `with engine.gathered_parameters():` "
                "(every rank enters it), take full weights from `model.state_dict()` or "
                "`engine.consolidated_state_dict()`, or convert a checkpoint with `zo checkpoint to-fp32`"
            )
        self.gathering.gather(index)
        self._running[-1][1].add(index)
        owner = next((m for m, _ in reversed(self._running) if self._gathers[m]), None)
        self._borrowed.setdefault(owner, set()).add(index)

    def describe(self, param: PartitionedParameter) -> str:
        return (
            f"PartitionedParameter(shape={list(param.shape)}, dtype={param.dtype}, partitioned by ZeRO stage 3: "
            "gather it with engine.gathered_parameters() to see its values)"
        )

    def begin_phase(self, phase: str) -> None:
        """A forward or backward starts: units borrowed outside any module are needed again by backward."""
        self._running.clear()
        if phase == "backward":
            for index in self._borrowed.get(None, ()):
                self.gathering.gather(index, prefetch=False)

    @contextlib.contextmanager
    def gathered(self, params=None, *, modifier_rank: int | None = None):
        """Full weights of `params` (default: all) on every rank until the block ends; a collective.

        With `modifier_rank`, what that rank wrote into them becomes every rank's weights (and masters)."""
        gathering = self.gathering
        if params is None:
            indices = list(range(len(gathering.units)))
        else:
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            indices = sorted({self.unit_of[id(p)][0] for p in params if id(p) in self.unit_of})
        newly = [index for index in indices if index not in gathering.held]  # an outer block keeps the rest
        for index in newly:
            gathering.gather(index, prefetch=False)
        gathering.held.update(newly)
        try:
            yield
        finally:
            gathering.held.difference_update(newly)
            try:
                if modifier_rank is not None:
                    gathering.adopt_full_weights(indices, modifier_rank)
            finally:
                for index in newly:
                    gathering.release(index)

    # -- state_dict: full weights, one module's units at a time ----------------------------------------------
    def _before_export(self, module, prefix, keep_vars) -> None:
        self._keep_vars = keep_vars
        if not keep_vars:  # keep_vars asks for the Parameter objects themselves: they stay partitioned
            for index in self._own_units(module):
                self.gathering.gather(index, prefetch=False)

    def _export_module(self, module, state_dict, prefix, local_metadata):
        if self._keep_vars:
            return None
        source, clones = self._export
        if source() is not state_dict:  # a new state_dict call: clones of earlier calls may be stale
            clones = {}
            self._export = (weakref.ref(state_dict), clones)
        for name, param in module._parameters.items():
            if id(param) in self.unit_of and prefix + name in state_dict:
                if id(param) not in clones:  # a tied weight is one tensor under both names, as without ZeRO
                    with torch._C.DisableTorchFunctionSubclass():
                        clones[id(param)] = param.detach().to("cpu", copy=True)
                state_dict[prefix + name] = clones[id(param)]
        for index in self._own_units(module):
            if index not in self.gathering.held:
                self.gathering.release(index)
        return None
