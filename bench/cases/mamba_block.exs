defmodule FusedKernels.Bench.MambaBlock do
  @moduledoc false
  alias FusedKernels.{Sample, MambaBlock}

  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    [
      %{
        name: "mamba_block exphil B1 L60 H256 (x2 layers)",
        shape: {1, 60, 256},
        type: {:f, 32},
        runner: &runner/1
      }
    ]
  end

  defp runner(:cuda_resident) do
    up = fn m ->
      Map.new(m, fn {k, v} ->
        {k, Map.new(v, fn {p, t} -> {p, FusedKernels.Buffer.upload(t)} end)}
      end)
    end

    layers = for _ <- 1..2, do: up.(Sample.mamba_block_params())
    x = FusedKernels.Buffer.upload(Sample.random_triple({1, 60, 256}, {:f, 32}))

    fn ->
      Enum.reduce(layers, x, fn p, h ->
        MambaBlock.native(h, p, backend: :cuda, out: :device)
      end)

      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(backend) when backend in [:cuda, :cpu] do
    layers = for _ <- 1..2, do: Sample.mamba_block_params()
    x = Sample.random_triple({1, 60, 256}, {:f, 32})
    fn -> Enum.reduce(layers, x, fn p, h -> MambaBlock.native(h, p, backend: backend) end) end
  end

  defp runner(_), do: nil
end
