// The architecture a kernel is built for, and the features it may use. FK_ARCH is
// __CUDA_ARCH__, or lower when the runtime builds a kernel "as" an older GPU (FK_CAP, e.g. 860:
// the code an RTX 30 runs, compiled for the GPU at hand so it can be checked and timed there).
// Every feature guard in the kernels reads FK_ARCH, never __CUDA_ARCH__, and the CI compiles one
// PTX per level (kernels.rs FEATURE_LEVELS), so a new threshold must be added there too.
//   750: the floor (mma.sync m16n8k8 f16, ldmatrix)
//   800: cp.async, mma.sync m16n8k16 bf16/f16 and m16n8k8 tf32
//   900: thread-block clusters, DSMEM, st.async, mbarrier transactions, PDL (griddepcontrol)
//  1200: consumer Blackwell (RTX 50): no new feature used, but it spills where Hopper does
//        not under some register budgets (a file may set its own there)
// (CI also compiles every file at 1000 and 1200 whatever its guards: NVRTC's code differs
// there; kernels.rs CODEGEN_LEVELS.)
// wgmma and TMA need Hopper's arch-specific target: FK_SM90A.
#pragma once

// A Hopper routed as an RTX 50 (FK_CAP 1200 on sm_90) builds the RTX 50's code too: it uses
// no feature Hopper lacks, only other register budgets.
#if defined(FK_CAP) && (FK_CAP < __CUDA_ARCH__ || (FK_CAP == 1200 && __CUDA_ARCH__ == 900))
#define FK_ARCH FK_CAP
#else
#define FK_ARCH __CUDA_ARCH__
#endif

// A capped build (FK_CAP: another GPU's code) never uses them.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(FK_CAP)
#define FK_SM90A 1
#else
#define FK_SM90A 0
#endif

// One kernel per program: the runtime defines FK_ONLY as the name of the kernel a call needs,
// and every other kernel of the file compiles to an empty body (instantiating nothing), so a
// first call compiles only what it launches. CI builds each file whole (no FK_ONLY). Each
// kernel's body is `if constexpr (FK_WANT(its name)) { ... }`; FK_LISTED_<name> comes from
// the file's instance table (kernels.rs), so a kernel the table lacks does not compile.
#define FK_STR_(x) #x
#define FK_STR(x) FK_STR_(x)
__host__ __device__ constexpr bool fk_same(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || fk_same(a + 1, b + 1));
}
#ifdef FK_ONLY
#define FK_WANT(name) (FK_LISTED_##name && fk_same(#name, FK_STR(FK_ONLY)))
#else
#define FK_WANT(name) FK_LISTED_##name
#endif

// An element type by its kernel-name part (DType::kernel_suffix), for the instance macros.
#define FK_T(TN) FK_T_##TN
#define FK_T_f32 float
#define FK_T_f16 fk_f16
#define FK_T_bf16 fk_bf16
// The cell by its name part (true: LSTM).
#define FK_LSTM(CN) FK_LSTM_##CN
#define FK_LSTM_lstm true
#define FK_LSTM_gru false
// Calls macro M with the arguments that `...` expands to (a part looked up as a list of
// template arguments, e.g. a tile's sizes).
#define FK_EXPAND(M, ...) M(__VA_ARGS__)
