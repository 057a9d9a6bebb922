"""Bound Triton launches on CPU: the specialization key against Triton's own, and the binding logic.

The key must never be coarser than Triton's specialization (two calls with one key must
compile to one kernel), so it is checked against Triton's own binder over many argument
tuples. The binding logic (when a call goes through Triton, when it replays the C launcher,
with which arguments) runs against a stand-in JIT function that records both paths.
"""

import itertools
import os
import random

import pytest
import torch
import triton.language as tl

from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels.launch import BoundKernel, specialization_key
from pagedkv.kernels.triton_decode_write import _decode_write_kernel


def _probe(x_ptr, y_ptr, scale, n, stride, flag, BLOCK: tl.constexpr):
    """A kernel signature for Triton's binder: two pointers, a float, ints, a bool, a constexpr."""


def _triton_specialization():
    """Triton 3.6's own specialization of `_probe`'s arguments (what picks the compiled kernel)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(_probe)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    return lambda *args: tuple(binder(*args, BLOCK=16)[1])


def _argument_tuples(count: int) -> list[tuple]:
    buffers = {dtype: torch.zeros(64, dtype=dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    tensors = [buffer[offset:] for buffer in buffers.values() for offset in (0, 1, 4, 8)]  # aligned or not
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**63, 2**63 + 16]
    scales = [0.5, 1.0, 2.0, 1, 2, 16]  # a float position given ints: 1 becomes a constant there too
    flags = [True, False]
    generator = random.Random(0)
    return [(generator.choice(tensors), generator.choice(tensors), generator.choice(scales), generator.choice(ints),
             generator.choice(ints), generator.choice(flags)) for _ in range(count)]


def test_key_is_at_least_as_fine_as_triton_specialization():
    triton_spec = _triton_specialization()
    calls = _argument_tuples(300)
    keys = [specialization_key(0, call[:2], [t.data_ptr() for t in call[:2]], call[2:]) for call in calls]
    specs = [triton_spec(*call) for call in calls]
    assert len(set(specs)) > 20  # the sample does exercise many specializations
    for (key_a, spec_a), (key_b, spec_b) in itertools.combinations(zip(keys, specs), 2):
        if key_a == key_b:
            assert spec_a == spec_b, (key_a, spec_a, spec_b)


def test_key_separates_what_triton_specializes():
    base = torch.zeros(32, dtype=torch.float16)
    key = lambda tensors, scalars, device=0: specialization_key(  # noqa: E731
        device, tensors, [t.data_ptr() for t in tensors], scalars)
    assert key((base,), (2,)) == key((base[8:],), (2,))  # both 16-byte aligned
    assert key((base,), (2,)) != key((base[1:],), (2,))  # 2 bytes off
    assert key((base,), (2,)) != key((base.bfloat16(),), (2,))
    assert key((base,), (2,)) != key((base,), (1,))  # 1 is compiled in as a constant
    assert key((base,), (1,)) != key((base,), (1.0,)) != key((base,), (True,))
    assert key((base,), (2,)) != key((base,), (2,), device=1)


# --------------------------------------------------------------------------- binding logic
class _FakeLauncher:
    """Stands in for Triton 3.6's CudaLauncher: its `launch` is the C function a binding calls."""

    def __init__(self, global_scratch_size=0):
        self.calls = []
        self.global_scratch_size = global_scratch_size
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = False

    def launch(self, *args):
        self.calls.append(args)


class _FakeCompiled:
    def __init__(self, launcher):
        self.run = launcher
        self.function = 0xF00
        self.packed_metadata = (4, 1, 0)


class _FakeJit:
    """A JIT function's launch surface: `fn[grid](*args, **kwargs)` launches and returns the compiled kernel."""

    arg_names = ["x_ptr", "y_ptr", "scale", "n", "BLOCK", "EVEN"]

    def __init__(self, global_scratch_size=0):
        self.triton_calls = []
        self.launcher = _FakeLauncher(global_scratch_size)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return _FakeCompiled(self.launcher)

        return launch


def _config(fn, **kwargs):
    config = BoundKernel(fn, bindable=True).config(BLOCK=64, EVEN=True, num_warps=4, **kwargs)
    config._current_device = lambda: 0  # no CUDA here: the device and stream a launch would read
    config._current_stream = lambda device: 0x5EED
    return config


def test_first_call_goes_through_triton_then_the_c_launcher_is_replayed():
    fn = _FakeJit()
    config = _config(fn)
    x, y = torch.zeros(16), torch.zeros(16)
    config.launch((3, 2, 1), (x, y), (0.5, 7))
    assert len(fn.triton_calls) == 1 and not fn.launcher.calls
    grid, args, kwargs = fn.triton_calls[0]
    assert grid == (3, 2, 1) and args == (x, y, 0.5, 7) and kwargs == dict(BLOCK=64, EVEN=True, num_warps=4)
    x2, y2 = torch.zeros(32), torch.zeros(32)  # other tensors, same dtype and alignment class
    config.launch((5, 2, 4), (x2, y2), (0.5, 7))
    assert len(fn.triton_calls) == 1
    (call,) = fn.launcher.calls
    assert call[:7] == (5, 2, 4, 0x5EED, 0xF00, False, False)  # grid, stream, function, cooperative, pdl
    assert call[7:13] == (None, None, (4, 1, 0), None, None, None)  # no scratch, packed metadata, no hooks
    assert call[13:] == (x2.data_ptr(), y2.data_ptr(), 0.5, 7, 64, True)  # runtime args then the constexprs
    assert (config.num_bound_launches, config.num_triton_launches) == (1, 1)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_for_float", "int_range"])
def test_a_new_specialization_launches_through_triton_again(change):
    fn = _FakeJit()
    config = _config(fn)
    buffer = torch.zeros(64)
    tensors, scalars = (buffer, buffer), (0.5, 7)
    config.launch((1, 1, 1), tensors, scalars)
    changed_tensors, changed_scalars = {
        "misaligned": ((buffer[1:], buffer), scalars),
        "dtype": ((buffer.double(), buffer), scalars),
        "int_one": (tensors, (0.5, 1)),
        "int_for_float": (tensors, (1, 7)),
        "int_range": (tensors, (0.5, 2**31 + 7)),
    }[change]
    config.launch((1, 1, 1), changed_tensors, changed_scalars)
    assert len(fn.triton_calls) == 2 and not fn.launcher.calls
    config.launch((1, 1, 1), changed_tensors, changed_scalars)  # now bound too
    config.launch((1, 1, 1), tensors, scalars)  # and the first one still is
    assert len(fn.triton_calls) == 2 and len(fn.launcher.calls) == 2
    assert config.num_bindings == 2


def test_constexprs_are_part_of_the_config():
    fn = _FakeJit()
    kernel = BoundKernel(fn, bindable=True)
    assert kernel.config(BLOCK=64, EVEN=True) is kernel.config(EVEN=True, BLOCK=64)
    assert kernel.config(BLOCK=64, EVEN=True) is not kernel.config(BLOCK=32, EVEN=True)


def test_launch_hooks_and_scratch_keep_triton_launch():
    from triton import knobs

    fn = _FakeJit()
    config = _config(fn)
    args = ((torch.zeros(4), torch.zeros(4)), (0.5, 7))
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        config.launch((1, 1, 1), *args)
        config.launch((1, 1, 1), *args)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(fn.triton_calls) == 2 and not fn.launcher.calls  # a profiler's hook sees every launch
    scratch_fn = _FakeJit(global_scratch_size=128)
    scratch_config = _config(scratch_fn)
    for _ in range(3):
        scratch_config.launch((1, 1, 1), *args)
    assert len(scratch_fn.triton_calls) == 3 and not scratch_fn.launcher.calls
    assert scratch_config.num_bindings == 0


def test_unbindable_kernel_always_launches_through_triton():
    fn = _FakeJit()
    config = BoundKernel(fn, bindable=False).config(BLOCK=64, EVEN=True)
    for _ in range(3):
        config.launch((1, 1, 1), (torch.zeros(4), torch.zeros(4)), (0.5, 7))
    assert len(fn.triton_calls) == 3 and not fn.launcher.calls


def test_constexprs_must_be_the_last_parameters():
    with pytest.raises(InvalidArgumentError, match="last parameters"):
        BoundKernel(_FakeJit(), bindable=True).config(BLOCK=64, scale=1.0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter fallback")
def test_interpreted_kernel_is_not_bound():
    assert not BoundKernel(_decode_write_kernel).bindable


def test_a_call_with_the_wrong_argument_count_is_refused():
    config = _config(_FakeJit())
    with pytest.raises(InvalidArgumentError, match="4 runtime arguments"):
        config.launch((1, 1, 1), (torch.zeros(4),), (0.5, 7))


def test_fixed_arguments_are_keyed_once_and_passed_after_the_calls_own():
    """`FixedArgs` (a decode step's metadata): in the launch after the call's tensors and scalars respectively."""
    fn = _FakeJit()  # parameters x_ptr, y_ptr, scale, n: the call gives x_ptr and scale, the fixed part y_ptr and n
    config = _config(fn)
    buffer = torch.zeros(64)
    x = torch.zeros(8)
    step_a = config.fix((buffer,), (7,))
    config.launch((1, 1, 1), (x,), (0.5,), step_a)
    assert fn.triton_calls[0][1] == (x, buffer, 0.5, 7)
    step_b = config.fix((buffer[4:],), (7,))  # another step whose metadata has the same key: no new binding
    config.launch((2, 1, 1), (x,), (0.5,), step_b)
    assert len(fn.triton_calls) == 1
    assert fn.launcher.calls[0][13:] == (x.data_ptr(), buffer[4:].data_ptr(), 0.5, 7, 64, True)
    for changed in (config.fix((buffer[1:],), (7,)), config.fix((buffer,), (1,))):  # misaligned; an int that is 1
        config.launch((1, 1, 1), (x,), (0.5,), changed)
    assert len(fn.triton_calls) == 3 and config.num_bindings == 3
