"""What a kernel boundary costs on this GPU, against a grid barrier inside one kernel: the
figures behind the replay step's shape (three launches a step, docs/benchmarks.md).

    python3 benchmarks/launch_costs.py [--launches 200] [--blocks 64 132]

Chains of dependent launches of 256-thread blocks, timed with CUDA events behind a spin
kernel (the queue fills, so the host's launch time is hidden), in µs per launch:
cooperative kernels that pass one grid barrier each (as replay_commit does), with and
without programmatic dependent launch (PDL: the next grid may start while this one ends;
it waits with griddepcontrol.wait), plain kernels likewise, and, for comparison, one
cooperative kernel passing as many grid barriers (the barrier of kernels/dueling_common.cuh).
The four chains of a figure are enqueued before the spin ends, so keep ``--launches`` within
what a stream holds pending (a few thousand launches); needs an sm_90 GPU (griddepcontrol).
"""

from __future__ import annotations

import argparse
import ctypes

import cupy as cp
import numpy as np

SOURCE = r"""
__device__ __forceinline__ void barrier(unsigned* arrivals, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(arrivals + blockIdx.x), "r"(target)
                     : "memory");
    if (threadIdx.x < 32)
        for (int i = threadIdx.x; i < (int)gridDim.x; i += 32) {
            unsigned seen;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals + i)
                             : "memory");
            } while ((int)(seen - target) < 0);
        }
    __syncthreads();
}
extern "C" __global__ void cooperative(unsigned* arrivals, unsigned target, int pdl, float* sink) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    barrier(arrivals, target);
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
    if (threadIdx.x == 0) sink[blockIdx.x] += 1.f;
}
extern "C" __global__ void plain(int pdl, float* sink) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
    if (threadIdx.x == 0) sink[blockIdx.x] += 1.f;
}
extern "C" __global__ void barriers(unsigned* arrivals, unsigned target, int n, float* sink) {
    for (int i = 0; i < n; ++i) {
        barrier(arrivals, target + i);
        if (threadIdx.x == 0) sink[blockIdx.x] += 1.f;
    }
}
extern "C" __global__ void spin(long long cycles) {
    const long long t = clock64();
    while (clock64() - t < cycles) {}
}
"""
COOPERATIVE, PROGRAMMATIC = 2, 6   # CUlaunchAttributeID values (cuda.h)


class _Value(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attribute(ctypes.Structure):   # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _Value)]


class _Config(ctypes.Structure):      # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]


class Chains:
    def __init__(self, launches: int):
        self.launches = launches
        self.module = cp.RawModule(code=SOURCE, options=("-arch=sm_90",))   # griddepcontrol
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.arrivals = cp.zeros(1024, np.uint32)
        self.sink = cp.zeros(1024, np.float32)
        self.target = 0

    def launch(self, name: str, blocks: int, args: list, *, cooperative: bool, pdl: bool):
        attrs = (_Attribute * 2)()
        n = 0
        for wanted, kind in ((cooperative, COOPERATIVE), (pdl, PROGRAMMATIC)):
            if wanted:
                attrs[n].id, attrs[n].value.flag = kind, 1
                n += 1
        config = _Config((blocks, 1, 1), (256, 1, 1), 0, self.stream.ptr, attrs, n)
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        status = self.driver.cuLaunchKernelEx(
            ctypes.byref(config), ctypes.c_void_p(self.module.get_function(name).kernel.ptr),
            params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernelEx of {name}: CUresult {status}")

    def time(self, chain) -> float:
        """µs per launch of ``chain()`` (``launches`` of them), three chains behind a spin."""
        with self.stream:
            self.module.get_function("spin")((1,), (1,), (np.int64(200_000_000),))
            chain()   # warm-up
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            for _ in range(3):
                chain()
            end.record(self.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e3 / (3 * self.launches)

    def cooperative(self, blocks: int, pdl: bool) -> float:
        def chain():
            for _ in range(self.launches):
                self.target += 1
                self.launch("cooperative", blocks, [
                    ctypes.c_void_p(self.arrivals.data.ptr), ctypes.c_uint(self.target),
                    ctypes.c_int(pdl), ctypes.c_void_p(self.sink.data.ptr)],
                    cooperative=True, pdl=pdl)
        return self.time(chain)

    def plain(self, blocks: int, pdl: bool) -> float:
        def chain():
            for _ in range(self.launches):
                self.launch("plain", blocks, [ctypes.c_int(pdl),
                                              ctypes.c_void_p(self.sink.data.ptr)],
                            cooperative=False, pdl=pdl)
        return self.time(chain)

    def barriers(self, blocks: int) -> float:
        def chain():
            self.launch("barriers", blocks, [
                ctypes.c_void_p(self.arrivals.data.ptr), ctypes.c_uint(self.target + 1),
                ctypes.c_int(self.launches), ctypes.c_void_p(self.sink.data.ptr)],
                cooperative=True, pdl=False)
            self.target += self.launches
        return self.time(chain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200, help="launches of a chain")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 132])
    args = parser.parse_args()
    chains = Chains(args.launches)
    print(f"## kernel boundaries on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()} "
          "(µs per launch or per barrier)")
    print("| blocks | cooperative, one barrier | + PDL | plain | + PDL | a barrier in one kernel |")
    print("|---|---|---|---|---|---|")
    for blocks in args.blocks:
        print(f"| {blocks} | {chains.cooperative(blocks, False):.2f} | "
              f"{chains.cooperative(blocks, True):.2f} | {chains.plain(blocks, False):.2f} | "
              f"{chains.plain(blocks, True):.2f} | {chains.barriers(blocks):.2f} |")


if __name__ == "__main__":
    main()
