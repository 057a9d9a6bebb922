"""Bound Triton launches: the compiled kernel's C launcher called directly, with only what changes per call.

`kernel[grid](*args, **constexprs)` costs about 58 us of host time on the H200 machine, for
a launch whose own cost (`cuLaunchKernelEx`) is a few. Triton 3.6 spends it in Python, on
every call: binding the arguments to the signature, specializing each one, turning the
options into a cache key, checking the kernel's globals, building launch metadata for a
launch hook chain that is usually empty, then in its C launcher calling `data_ptr()` and
`cuPointerGetAttribute` for every tensor. A decode step of a small model is host-bound,
so that is the step's time.

`BoundKernel(fn).config(**constexprs_and_options)` fixes what a caller keeps constant. Its
`launch(grid, tensors, scalars)` looks the call's specialization key up; the first call of a
key launches through Triton (compiling if needed) and keeps what it launched (the C launcher,
the `CUfunction`, the packed metadata); later calls go straight to that C launcher, with
each tensor passed as its `data_ptr()` int, which the launcher takes as the address as is.

The key. Triton compiles one kernel per specialization of the runtime arguments (3.6):

    tensor   its dtype, and whether data_ptr % 16 == 0 (then the kernel may vectorise loads)
    int      i32 / i64 / u64 by range, whether it is divisible by 16; an int equal to 1
             becomes a compile-time constant
    float    fp32, not specialized; bool u1; None a constant

A call that ran a kernel compiled for another specialization would be silently wrong (a
16-byte load from an 8-byte-aligned address, a stride of 2 read as the constant 1). So the
key here is at least as fine as Triton's: the current device, each tensor's dtype and
`data_ptr() % 16`, and every scalar's type and exact value (finer than needed, never
coarser). Scalars must therefore stay stable from call to call (strides, a window, a split
count): one that changes on every call, such as a sequence length, misses every time and
pays Triton's full launch (correct, not cheap). Keep those in device memory.

Never bound, every call through Triton: the interpreter (TRITON_INTERPRET=1, where
`triton.jit` yields no compiled kernel), any launch hook installed (profilers such as proton
read the launch metadata), and kernels that need per-launch scratch memory.
"""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError

#: A kernel's runtime arguments, in signature order: tensors first, then scalars, then the constexprs (fixed
#: by the config). Tensors must be torch.Tensors (pass a dummy for an unused pointer, never None).
TensorArgs = tuple  # tuple[torch.Tensor, ...]
ScalarArgs = tuple  # tuple[int | float | bool, ...]


def _is_compiled(fn) -> bool:
    """Whether `fn` is a Triton JITFunction on a CUDA build (under TRITON_INTERPRET=1 it is an interpreter)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(fn, JITFunction) and torch.cuda.is_available() and torch.version.hip is None


def _hooks_installed(runtime) -> bool:
    """Whether a Triton launch hook is set in `triton.knobs.runtime` (it must see every launch)."""
    for hooks in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hooks is not None and getattr(hooks, "calls", True):  # 3.6: an empty HookChain; older: a callable
            return True
    return False


def specialization_key(device: int, tensors: TensorArgs, pointers: list[int], scalars: ScalarArgs,
                       fixed_id: int = -1) -> tuple:
    """The binding key of a call (`pointers`: the tensors' data_ptr()): at least as fine as Triton's specialization.

    `fixed_id` stands for the key of the call's `FixedArgs` (-1: none).
    """
    return (device, fixed_id, tuple([t.dtype for t in tensors]), tuple([p & 15 for p in pointers]),
            tuple(map(type, scalars)), scalars)


class FixedArgs:
    """Arguments that many launches share (a decode step's metadata), with their part of the key made once.

    Made by `BoundConfig.fix`; `launch(..., fixed=)` then keys only the call's own arguments.
    In the kernel's signature the fixed tensors follow the call's tensors, and the fixed
    scalars follow the call's scalars.
    """

    __slots__ = ("tensors", "scalars", "pointers", "key_id")

    def __init__(self, tensors: TensorArgs, scalars: ScalarArgs, pointers: list[int], key_id: int):
        self.tensors = tensors
        self.scalars = scalars
        self.pointers = pointers
        self.key_id = key_id  # one small int per distinct (dtypes, alignments, scalar types and values)


class _Binding:
    """What one compiled specialization needs to be launched again: the C launcher and its fixed arguments."""

    __slots__ = ("compiled", "c_launch", "function", "packed_metadata", "cooperative", "pdl")

    def __init__(self, compiled, c_launch, function: int, packed_metadata: tuple, cooperative: bool, pdl: bool):
        self.compiled = compiled  # held, so the module that `function` lives in stays loaded
        self.c_launch = c_launch
        self.function = function
        self.packed_metadata = packed_metadata
        self.cooperative = cooperative
        self.pdl = pdl

    @classmethod
    def of(cls, compiled) -> _Binding | None:
        """The binding of a CompiledKernel, or None where its launch cannot be replayed this way."""
        if hasattr(compiled, "result"):  # async compilation hands out a future
            compiled = compiled.result()
        launcher = getattr(compiled, "run", None)
        c_launch = getattr(launcher, "launch", None)
        if c_launch is None or getattr(compiled, "function", None) is None:
            return None  # another Triton version or backend: keep Triton's own launch
        # Per-launch scratch is allocated by Triton's Python launcher; such a kernel stays unbound.
        if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
            return None
        return cls(compiled, c_launch, compiled.function, compiled.packed_metadata,
                   bool(launcher.launch_cooperative_grid), bool(launcher.launch_pdl))


#: Stands in the bindings of a key whose kernel cannot be bound, so the check runs once.
_UNBINDABLE = object()


class BoundConfig:
    """A kernel with its constexprs and options fixed; `launch` reuses the compiled kernel of each key."""

    def __init__(self, fn, kwargs: dict, bindable: bool):
        self.fn = fn
        self.kwargs = dict(kwargs)
        self.bindable = bindable
        names = list(fn.arg_names)
        constexprs = [name for name in names if name in kwargs]
        # The C launcher takes every parameter in order; constexprs last lets it be (tensors, scalars, constexprs).
        if names[len(names) - len(constexprs):] != constexprs:
            raise InvalidArgumentError(f"{fn}: the constexprs {constexprs} must be the kernel's last parameters")
        self.num_runtime_args = len(names) - len(constexprs)
        self.constexpr_values = tuple(kwargs[name] for name in constexprs)
        self._bindings: dict[tuple, _Binding | object] = {}
        self._fixed_ids: dict[tuple, int] = {}
        # Launches so far by path: a benchmark reads these to see that no timed step paid Triton's launch.
        self.num_bound_launches = 0
        self.num_triton_launches = 0
        if bindable:
            from triton import knobs

            self._runtime = knobs.runtime
            # What Triton's own launch calls for the device and the stream (the raw handle, no Stream object).
            self._current_device = torch.cuda.current_device
            self._current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) \
                or (lambda device: torch.cuda.current_stream(device).cuda_stream)

    @property
    def num_bindings(self) -> int:
        """Specializations bound so far (each was launched once through Triton)."""
        return sum(binding is not _UNBINDABLE for binding in self._bindings.values())

    def fix(self, tensors: TensorArgs, scalars: ScalarArgs) -> FixedArgs:
        """`FixedArgs` of these tensors and scalars (their key part computed here, once)."""
        pointers = [t.data_ptr() for t in tensors]
        key = specialization_key(0, tensors, pointers, scalars)[2:]
        key_id = self._fixed_ids.setdefault(key, len(self._fixed_ids))
        return FixedArgs(tuple(tensors), tuple(scalars), pointers, key_id)

    def launch(self, grid: tuple[int, int, int], tensors: TensorArgs, scalars: ScalarArgs,
               fixed: FixedArgs | None = None) -> None:
        """Launch on `grid` (three ints) on the current stream.

        The kernel's runtime arguments are `tensors`, then `fixed.tensors`, then `scalars`, then
        `fixed.scalars` (no `fixed`: `tensors`, then `scalars`).
        """
        key = None
        if self.bindable and not _hooks_installed(self._runtime):
            device = self._current_device()
            pointers = [t.data_ptr() for t in tensors]
            key = specialization_key(device, tensors, pointers, scalars, -1 if fixed is None else fixed.key_id)
            binding = self._bindings.get(key)
            if binding is not None and binding is not _UNBINDABLE:
                if fixed is not None:
                    pointers += fixed.pointers
                    scalars += fixed.scalars
                binding.c_launch(grid[0], grid[1], grid[2], self._current_stream(device),
                                 binding.function, binding.cooperative, binding.pdl, None, None,
                                 binding.packed_metadata, None, None, None,
                                 *pointers, *scalars, *self.constexpr_values)
                self.num_bound_launches += 1
                return
        if fixed is not None:
            tensors, scalars = tensors + fixed.tensors, scalars + fixed.scalars
        if len(tensors) + len(scalars) != self.num_runtime_args:
            raise InvalidArgumentError(f"{self.fn} takes {self.num_runtime_args} runtime arguments, got "
                                       f"{len(tensors)} tensors and {len(scalars)} scalars")
        self.num_triton_launches += 1
        compiled = self.fn[grid](*tensors, *scalars, **self.kwargs)
        if key is not None and key not in self._bindings:
            self._bindings[key] = _Binding.of(compiled) or _UNBINDABLE


class BoundKernel:
    """A Triton kernel whose launches reuse the compiled kernel (see the module docstring).

    `bindable=None` decides from `fn`: a compiled JITFunction on CUDA is bound; an interpreted
    one (TRITON_INTERPRET=1) or anything else always launches through Triton.
    """

    def __init__(self, fn, *, bindable: bool | None = None):
        self.fn = fn
        self.bindable = _is_compiled(fn) if bindable is None else bindable
        self._configs: dict[tuple, BoundConfig] = {}

    @property
    def launch_counts(self) -> tuple[int, int]:
        """(bound launches, launches through Triton) over every config so far."""
        configs = self._configs.values()
        return sum(c.num_bound_launches for c in configs), sum(c.num_triton_launches for c in configs)

    def config(self, **kwargs) -> BoundConfig:
        """The launcher for these constexprs and options (num_warps, num_stages, ...), made once per set."""
        key = tuple(sorted(kwargs.items()))
        config = self._configs.get(key)
        if config is None:
            config = self._configs[key] = BoundConfig(self.fn, kwargs, self.bindable)
        return config


_BOUND: dict = {}


def bound(fn) -> BoundKernel:
    """The process-wide `BoundKernel` of `fn`, made on first use.

    Looked up at call time (a dict lookup), so a caller that replaces a module's kernel
    attribute (a benchmark stubbing launches out) is still obeyed.
    """
    kernel = _BOUND.get(fn)
    if kernel is None:
        kernel = _BOUND[fn] = BoundKernel(fn)
    return kernel
