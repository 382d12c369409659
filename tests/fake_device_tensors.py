"""fakegpu tensors over CPU memory: the device's name, index and RNG stream; wrapping, CPU views, resizing.

Shared by the other fake_device_*.py files; tests/fake_device.py says how the device works.
"""

from __future__ import annotations

import weakref

import torch

NAME = "fakegpu"
# torch.device("fakegpu", 0) can only be built after the rename; enable_fake_device() fills it in.
_DEV0: torch.device | None = None  # what tensors and storages report
_CPU = torch.device("cpu")
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_OWNER_ATTR = "_fakegpu_cpu_owner"

aten = torch.ops.aten
_SET_STORAGE = aten.set_.source_Storage_storage_offset

# RNG of the fake device: kept apart from the CPU default generator, as a GPU's is.
_generator = torch.Generator()


# ----------------------------------------------------------------------------------------------
# Moving between CPU memory and fakegpu tensors
# ----------------------------------------------------------------------------------------------


def _is_fake(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == NAME


class DeviceMemory:
    """Bytes held by live fakegpu storages, their peak, and an optional capacity (None: unbounded).

    Frees arrive from weakref callbacks, on whichever thread the garbage collector runs, maybe in
    the middle of an allocation: they are queued (list.append is atomic) and applied by the next
    reader, so no lock is ever taken inside a callback."""

    def __init__(self):
        self._allocated = self._peak = 0
        self.capacity: int | None = None
        self._watched: set = set()  # weak references whose callbacks give the bytes back
        self._freed: list[int] = []

    def _apply_frees(self) -> None:
        while self._freed:
            self._allocated -= self._freed.pop()

    @property
    def allocated(self) -> int:
        self._apply_frees()
        return self._allocated

    @property
    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.allocated

    def take(self, nbytes: int) -> None:
        in_use = self.allocated
        if self.capacity is not None and in_use + nbytes > self.capacity:
            raise torch.OutOfMemoryError(
                f"{NAME} out of memory: tried to allocate {nbytes} bytes with {in_use} of "
                f"{self.capacity} bytes in use")
        self._allocated += nbytes
        self._peak = max(self._peak, self._allocated)

    def watch(self, storage, nbytes: int) -> None:
        # a bare weakref with a callback: cheaper than weakref.finalize, paid on every op
        self._watched.add(weakref.ref(storage, lambda ref: self._release(ref, nbytes)))

    def _release(self, ref, nbytes: int) -> None:
        self._watched.discard(ref)
        self._freed.append(nbytes)


MEMORY = DeviceMemory()


def _fake_storage(cpu_storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A fakegpu storage over a CPU storage's memory, counted in MEMORY while it lives.

    The storage built from a raw pointer owns nothing, so the CPU storage rides along as an
    attribute: torch preserves a storage's Python object (and its attributes) for as long as the
    C++ storage lives, so the CPU memory lives exactly as long as the fakegpu storage.
    """
    nbytes = cpu_storage.nbytes()
    if nbytes:
        MEMORY.take(nbytes)
    st = torch._C._construct_storage_from_data_pointer(cpu_storage.data_ptr(), _DEV0, nbytes)
    setattr(st, _OWNER_ATTR, cpu_storage)
    if nbytes:
        MEMORY.watch(st, nbytes)
    return st


def _point_at(fake: torch.Tensor, storage, offset, size, stride) -> torch.Tensor:
    # The CPU kernel of set_ only edits TensorImpl metadata and checks that devices match, so it
    # can point a fakegpu tensor at a fakegpu storage without touching memory.
    return _SET_STORAGE.redispatch(_CPU_KEYS, fake, storage, offset, size, stride)


def _new_fake(dtype, storage, offset, size, stride) -> torch.Tensor:
    return _point_at(torch._C._acc.create_empty_tensor([0], dtype), storage, offset, size, stride)


def _wrap(cpu: torch.Tensor) -> torch.Tensor:
    """A fakegpu tensor sharing (and keeping alive) the memory of a CPU tensor."""
    return _new_fake(cpu.dtype, _fake_storage(cpu.untyped_storage()), cpu.storage_offset(), cpu.size(), cpu.stride())


def _cpu_view(fake: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as a fakegpu tensor, valid while ``fake`` lives.

    Its storage is a non-owning, non-resizable view: a CPU kernel that tried to reallocate it
    would raise instead of freeing memory that fakegpu tensors still point at.
    """
    st = fake.untyped_storage()
    cpu_st = torch._C._construct_storage_from_data_pointer(st.data_ptr(), _CPU, st.nbytes())
    return torch.empty(0, dtype=fake.dtype).set_(cpu_st, fake.storage_offset(), fake.size(), fake.stride())


def _alloc(size, stride, dtype) -> torch.Tensor:
    cpu = torch.empty_strided(size, stride, dtype=dtype or torch.get_default_dtype())
    return _wrap(cpu)


def _same_device_error(op_name: str) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{NAME}:0 and cpu! (when checking argument for {op_name})"
    )


# resize_ (and out= arguments that grow): a new storage when the old one is too small


def _resize(self, size, memory_format=None):
    size = list(size)
    if size == list(self.size()) and memory_format is None:
        return self  # as at::resize_: same size keeps the strides (in-place ops on views rely on it)
    numel = 1
    for s in size:
        numel *= s
    needed = (self.storage_offset() + numel) * self.element_size()
    st = self.untyped_storage()
    if needed > st.nbytes():
        # Grow into a new CPU allocation, keeping the old bytes, as a storage resize would.
        cpu = torch.empty(needed, dtype=torch.uint8)
        cpu[: st.nbytes()].copy_(_cpu_view_bytes(st))
        st = _fake_storage(cpu.untyped_storage())
    fmt = memory_format or torch.contiguous_format
    stride = torch.empty(size, device="meta", memory_format=fmt).stride() if size else ()
    _point_at(self, st, self.storage_offset(), size, stride)
    return self


def _cpu_view_bytes(fake_storage) -> torch.Tensor:
    cpu_st = torch._C._construct_storage_from_data_pointer(fake_storage.data_ptr(), _CPU, fake_storage.nbytes())
    return torch.empty(0, dtype=torch.uint8).set_(cpu_st)
