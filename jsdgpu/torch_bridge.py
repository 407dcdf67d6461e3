"""The bridge between torch tensors and the core's arrays (jsdgpu.call's, through jsdgpu.torch):
zero-copy views both ways, CuPy on torch's current stream with memory from torch's caching
allocator (on the CPU, the products by torch's BLAS or NumPy's, the faster), the operands'
dtype under autocast, and the custom operators' outputs in tensors torch allocated."""

import functools

import ml_dtypes
import numpy as np
import torch

from .call import backward


# NumPy's dtype of each torch dtype a CUDA tensor crosses to CuPy as, by its pointer (to_native)
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                 torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float64: np.dtype(np.float64),
                 torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.int16: np.dtype(np.int16),
                 torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)}

_TORCH_DTYPES = {n: t for t, n in _NUMPY_DTYPES.items()}


def torch_dtype(dtype):
    """The torch dtype of a NumPy dtype (one of _NUMPY_DTYPES')."""
    return _TORCH_DTYPES[np.dtype(dtype)]


def to_native(t):
    """A CuPy (CUDA) or NumPy (CPU) view of the tensor t, zero-copy. A CUDA tensor of a dtype CuPy
    holds is viewed by its pointer and strides, the tensor kept alive by the view: 4 µs, where
    DLPack's exchange (torch's __dlpack__, its stream handshake, the capsule) took 18, host time
    before the step's first product (docs/design.md, "The front ends")."""
    if t.is_cuda:
        import cupy
        dtype = _NUMPY_DTYPES.get(t.dtype)
        if dtype is None or t.numel() == 0:
            return cupy.from_dlpack(t.detach())
        if t.is_contiguous():  # the common case: its size, and CuPy's own strides without working them out
            elements, strides = t.numel(), None
        else:
            elements = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            strides = tuple(dtype.itemsize * s for s in t.stride())
        memory = cupy.cuda.UnownedMemory(t.data_ptr(), dtype.itemsize * elements, t, t.get_device())
        return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0), strides)
    t = t.detach()
    if t.dtype == torch.bfloat16:  # NumPy's DLPack has no bfloat16: cross as int16 bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_native(a):
    """A tensor viewing the CuPy or NumPy array a, zero-copy."""
    if isinstance(a, np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


class _TorchBlock:
    """A block of torch's caching allocator, given back to it when the CuPy memory object that
    holds this is freed."""
    __slots__ = ("pointer",)
    # bound here: a block still held at the interpreter's exit is freed after this module's globals
    _free = staticmethod(getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None))

    def __init__(self, pointer):
        self.pointer = pointer

    def __del__(self):
        self._free(self.pointer)


def _torch_memory(device, nbytes):
    """CuPy memory from torch's caching allocator on the device (its index, current in the block
    that installs this) for CuPy's current stream, by the allocator's raw allocation (what
    torch.cuda.caching_allocator_alloc calls, without that wrapper's device switch). The stream is
    CuPy's, not torch's: a block allocated beside the caller's stream (kernels.beside, where the
    selection runs beside the head's products) is one freed on that side stream, never one freed
    on the caller's stream a moment before that the caller's queued products may still be using,
    as in CuPy's own pool. A uint8 tensor, which torch allocates for its own current stream, could
    be such a block (docs/design.md, "The front ends")."""
    import cupy
    pointer = torch._C._cuda_cudaCachingAllocator_raw_alloc(nbytes, cupy.cuda.get_current_stream().ptr)
    # the device given: else CuPy asks the driver for the pointer's attributes at every allocation
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(pointer, nbytes, _TorchBlock(pointer), device), 0)


def _torch_matmul(a, b, out):
    """out = a @ b by torch's CPU BLAS, on views of the NumPy arrays (jsdgpu.cpu.products)."""
    torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))
    return out


def current_stream(t):
    """For the block: CuPy on t's device, on torch's current stream, with memory from torch; on
    the CPU, the products by torch's BLAS or NumPy's, whichever ran a trial faster
    (jsdgpu.cpu.products.faster_of)."""
    if not t.is_cuda:
        from .cpu.products import faster_of
        return faster_of(_torch_matmul)
    device = t.get_device()
    return _OnTorchStream(device, _cupy_stream(_raw_stream(device), device))


class _OnTorchStream:
    """The block of current_stream on a CUDA device: CuPy's and torch's current device, CuPy's
    current stream (torch's, made once by its pointer) and allocator (torch's). Four contexts
    entered and left in order, as contextlib.ExitStack would, without its bookkeeping: this is
    host time before the step's first product, where Python runs two to six times slower than
    back to back (docs/design.md, "The front ends")."""
    __slots__ = ("_contexts",)

    def __init__(self, device, stream):
        import cupy
        self._contexts = (cupy.cuda.Device(device), torch.cuda.device(device), stream,
                          cupy.cuda.using_allocator(_allocator(device)))

    def __enter__(self):
        for entered, context in enumerate(self._contexts):
            try:
                context.__enter__()
            except BaseException:
                _leave(self._contexts[:entered], (None, None, None))
                raise
        return self

    def __exit__(self, *exc):
        _leave(self._contexts, exc)


def _leave(contexts, exc):
    """Leave the contexts in reverse order, every one even where one fails to leave (a device or
    stream not restored would outlive the call), then raise the first failure (as
    contextlib.ExitStack does, it replaces an exception that was on its way out, which becomes
    its __context__)."""
    failure = None
    for context in reversed(contexts):
        try:
            context.__exit__(*exc)
        except BaseException as error:
            failure = failure or error
    if failure is not None:
        raise failure


# torch's own accessor of the current stream's pointer (what Inductor's code calls), where
# torch.cuda.current_stream makes a Stream object first; absent from a CPU build
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(device):
    """The pointer of torch's current stream on the device."""
    if _CURRENT_RAW_STREAM is None:
        return torch.cuda.current_stream(device).cuda_stream
    return _CURRENT_RAW_STREAM(device)


# Made once: each is host time before the step's first product (and CuPy's ExternalStream warns
# that it is deprecated at every construction). A stream is known by its pointer alone.
@functools.lru_cache(maxsize=64)
def _cupy_stream(pointer, device):
    import cupy
    return cupy.cuda.ExternalStream(pointer, device)


@functools.lru_cache(maxsize=None)
def _allocator(device):
    return functools.partial(_torch_memory, device)


class GradWeight:
    """A loss operator's float32 grad_weight (an fp32 master weight's), made when first asked for:
    by the core, as its float32 sum over the chunks (api.forward_with's weight_memory: called
    where G is not held), so that backward writes nothing more there, or else by operator_outputs
    for backward's product, after forward (made before it, it would add its size to the peak of a
    call holding G)."""
    __slots__ = ("weight", "tensor")

    def __init__(self, weight):
        self.weight, self.tensor = weight, None

    def get(self):
        if self.tensor is None:
            self.tensor = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        return self.tensor

    def __call__(self):
        return to_native(self.get())

    @staticmethod
    def of(student_weight, compute_grad):
        """A GradWeight where the operator's grad_weight is float32, else None."""
        return GradWeight(student_weight) if compute_grad and student_weight.dtype == torch.float32 else None


def operator_outputs(loss, ctx, compute_grad, student_input, student_weight, student_bias, grad_weight=None):
    """The loss operators' outputs: the loss, its parts and the student's gradients (each in its
    tensor's dtype; empty without compute_grad, or without a bias), each a tensor torch allocated,
    not a view of the core's arrays (from_native's): torch.compile's CUDA-graph trees
    (mode="reduce-overhead") take over the storage of a graph's outputs, which must be the
    caching allocator's own. The gradients are written into such tensors (grad_weight into
    grad_weight's, a GradWeight, where given); the parts are copied."""
    device = loss.device
    grads = [torch.empty(0, device=device) for _ in range(3)]  # distinct: returns may not alias
    if compute_grad:
        input_dtype, weight_dtype = map(torch_dtype, ctx.gradient_dtypes())
        out = (torch.empty(student_input.shape, dtype=input_dtype, device=device),
               torch.empty(student_weight.shape, dtype=weight_dtype, device=device) if grad_weight is None
               else grad_weight.get(),
               None if student_bias is None else torch.empty(student_bias.shape, dtype=weight_dtype, device=device))
        backward(ctx, out=out)
        grads[:2] = out[0].to(student_input.dtype), out[1].to(student_weight.dtype)
        if student_bias is not None:
            grads[2] = out[2].to(student_bias.dtype)
    return loss.clone(), ctx.soft_loss.clone(), ctx.hard_loss.clone(), *grads


def as_rows(t, *width):
    """t as [rows, *width] (labels and weights: [rows]): itself where it is so already; a reshape
    is host time before the step's first product, and a node of its own in backward."""
    return t if t.dim() == 1 + len(width) else t.reshape(-1, *width)


def weight_rows(token_weights):
    """token_weights as [rows] (as_rows; None stays None). The loss takes them as constants: one
    that wants a gradient raises, as PyTorch's own losses do for their `weight`, where the loss
    would otherwise leave it without one (docs/contract.md, "Front ends")."""
    if token_weights is None:
        return None
    if token_weights.requires_grad and torch.is_grad_enabled():
        raise ValueError("token_weights: the loss gives no gradient in the token weights (pass them detached; for "
                         "one, multiply the rows' losses of reduction='none' by them)")
    return as_rows(token_weights)


def rows_shaped(result, reduction, labels):
    """The loss (or loss, soft, hard) of reduction "none" in the labels' shape; else as it is."""
    if reduction != "none":
        return result
    return result.reshape(labels.shape) if isinstance(result, torch.Tensor) else tuple(
        r.reshape(labels.shape) for r in result)


def caster(compute_dtype):
    """The operands' cast to autocast's dtype (None: as they are)."""
    return (lambda a: a) if compute_dtype is None else (lambda a: None if a is None else a.to(compute_dtype))


def check_dtypes(compute_dtype, *pairs):
    """pairs: (name, input, weight); each pair of one dtype, outside autocast."""
    if compute_dtype is None:
        for name, x, w in pairs:
            if x.dtype != w.dtype:
                raise TypeError(f"the {name} input ({x.dtype}) and weight ({w.dtype}) must have the same dtype: "
                                "cast one of them, or run the loss under torch.autocast, which computes in "
                                "its 16-bit dtype and returns each gradient in its tensor's dtype")


def autocast_dtype(device_type):
    """The operands' dtype under autocast on the device type, or None outside autocast."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
