# Compiled only where EXLA (≥ 0.12, with its `EXLA.CustomCall` protocol) is a dependency that
# compiles before this project (list `:exla` before `:fused_kernels` in your deps).
if Code.ensure_loaded?(EXLA.CustomCall) and Code.ensure_loaded?(Nx) do
  defimpl EXLA.CustomCall, for: FusedKernels.XLA.Block do
    def call(block, out, args, client), do: FusedKernels.XLA.spec(block, out, args, client)
  end
end
