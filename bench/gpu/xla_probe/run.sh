#!/usr/bin/env bash
# Controls for bench/RESULTS.md "XLA FFI handlers under JAX": what a custom call costs inside
# XLA's command buffers apart from fused_kernels, and our attention beside the same kernel body
# launched as XLA's own kernel node. Run on the GPU machine (nvcc, JAX 0.11) from the repository
# root: `bash bench/gpu/xla_probe/run.sh .gpu/xla/libfused_kernels_xla.so $OUT`
# (the library from bench/gpu/xla_ffi_build.sh).
#   graph_child: per node, a kernel node vs the same kernel in a child-graph node (CUDA only);
#   probe.py:    per call in one command buffer, an XLA fusion vs the same kernel from a C++ FFI
#                handler vs an FFI handler that launches nothing vs `__gpu$xla.gpu.ptx`;
#   fa_chain.py: attention chains of 200 (our handler, its body as XLA's kernel node, JAX), and
#                the same calls in a fori_loop as one command buffer, with and without out
#                aliasing q.
set -eu
LIB=$(realpath "$1")
OUT=$(realpath -m "${2:-out}")
mkdir -p "$OUT"
cd "$(dirname "$0")"
K=../../../native/fused_kernels_core/kernels
INC=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
B=$(mktemp -d)
nvcc -O2 -arch=sm_90 -o "$B/graph_child" graph_child.cu
nvcc -O2 -arch=sm_90 -std=c++17 -shared -Xcompiler -fPIC -I"$INC" -o "$B/libffi_probe.so" ffi_probe.cu
nvcc -ptx -arch=sm_90 -o "$B/tiny.ptx" tiny.cu
nvcc -ptx -arch=sm_90 -std=c++17 -I$K/include -I$K -DFK_ONLY=fa_xla_none -o "$B/probe_fa.ptx" probe_fa.cu
CB="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT --xla_gpu_graph_min_graph_size=1"
LOOP="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$B/graph_child" | tee "$OUT/graph_child.log"
XLA_FLAGS="$CB" python3 probe.py "$B/libffi_probe.so" "$B/tiny.ptx" " cb" | tee "$OUT/probe.log"
XLA_FLAGS="$CB" python3 fa_chain.py --ffi ours="$LIB" --ptx "$B/probe_fa.ptx" | tee "$OUT/fa_chain.log"
XLA_FLAGS="$LOOP" python3 fa_chain.py --loop --alias --ffi ours="$LIB" | tee "$OUT/fa_loop.log"
rm -rf "$B"
