"""Test hooks: the documented switches through which tests (and benches comparing paths) reach code paths
this machine would not take on its own. Nothing else in the library writes them; users never need them.

    from nsa.hooks import HOOKS
    monkeypatch.setattr(HOOKS, "providers", {...})   # a field, restored after the test

Fields of the one `HOOKS` object:

- providers: the compressed / sliding branch providers by name ("flash_attn", "torch_flash", "sdpa"),
  used instead of nsa.plan.providers.PROVIDERS (CPU tests install emulated FA-2 kernels);
- cudnn: the torch_cudnn provider used instead of nsa.plan.providers.CUDNN;
- tma: False reads every K/V tile through pointers, never through TMA descriptors (GPU tests compare both);
- tma_force: descriptors on any device and dtype (Triton's interpreter runs them on CPU tensors);
- cache_cpu_plans: plans of CPU calls are cached as CUDA calls' are (tests of the plan cache);
- pretend_gpu: a compute capability (major, minor): the kernels' launchers treat tensors on any device as
  on a GPU of that capability and choose its launch parameters (bench/triton_compile_check.py records
  the launches and compiles them for that target; nothing can run then).

Per-provider hooks are fields of the provider objects themselves (nsa.plan.providers: `capability`,
`allow_cpu`, `kernel_dtypes`, `available_override`). This module imports nothing of the library, so every
layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TestHooks:
    __test__ = False  # not a pytest test class

    providers: dict | None = None
    cudnn: object | None = None
    tma: bool = True
    tma_force: bool = False
    cache_cpu_plans: bool = False
    pretend_gpu: tuple[int, int] | None = None


HOOKS = TestHooks()

__all__ = ["HOOKS", "TestHooks"]
