// Programmatic dependent launch (sm_90+; without the launch attribute, and below sm_90, both
// are no-ops): wait for the grid this one depends on to finish (its writes visible), and let
// the next grid start its prologue. A header of its own: its FK_ARCH >= 900 guard makes CI
// compile a level-900 PTX of every file that includes it (kernels.rs feature_level), which
// only the files that launch dependents need.
#pragma once
#include "arch.cuh"

__device__ __forceinline__ void fk_pdl_wait() {
#if FK_ARCH >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void fk_pdl_launch_dependents() {
#if FK_ARCH >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
