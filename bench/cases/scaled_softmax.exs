defmodule FusedKernels.Bench.ScaledSoftmax do
  @moduledoc false
  alias FusedKernels.{Sample, ScaledSoftmax}

  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    [
      {"scaled_softmax exphil scores", {1, 4, 60, 60}, {:f, 32}, [scale: 0.125, causal: true]},
      {"scaled_softmax B4 H16 512x512", {4, 16, 512, 512}, {:bf, 16}, [scale: 0.125]}
    ]
    |> Enum.map(fn {name, shape, type, opts} ->
      %{name: name, shape: shape, type: type, runner: &runner(&1, shape, type, opts)}
    end)
  end

  defp runner(:cuda_resident, shape, type, opts) do
    # Input already on the GPU, output left there; timed until the device is idle.
    x = FusedKernels.Buffer.upload(Sample.random_triple(shape, type))

    fn ->
      ScaledSoftmax.native(x, [backend: :cuda, out: :device] ++ opts)
      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(backend, shape, type, opts) when backend in [:cuda, :cpu] do
    x = Sample.random_triple(shape, type)
    fn -> ScaledSoftmax.native(x, [backend: backend] ++ opts) end
  end

  defp runner(:nx, shape, type, opts) do
    # Pure Nx on the configured Nx backend; skipped for big shapes (minutes per run).
    if Tuple.product(shape) <= 100_000 and Code.ensure_loaded?(Nx) do
      {bin, _, _} = Sample.random_triple(shape, type)
      x = apply(Nx, :reshape, [apply(Nx, :from_binary, [bin, type]), shape])
      fn -> apply(ScaledSoftmax, :nx, [x, opts]) end
    end
  end
end
