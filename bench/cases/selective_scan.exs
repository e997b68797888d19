defmodule FusedKernels.Bench.SelectiveScan do
  @moduledoc false
  alias FusedKernels.{Sample, SelectiveScan}

  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    [
      {"selective_scan B32 D512 L60 N16", {32, 60, 512}, 16},
      {"selective_scan B8 D2048 L4096 N16", {8, 4096, 2048}, 16}
    ]
    |> Enum.map(fn {name, shape, n} ->
      %{name: name, shape: shape, type: {:f, 32}, runner: &runner(&1, shape, n)}
    end)
  end

  defp inputs({b, l, d}, n) do
    t = {:f, 32}

    delta =
      {Sample.encode_values(for(_ <- 1..(b * l * d), do: :rand.uniform() * 0.1), t), {b, l, d}, t}

    a = {Sample.encode_values(for(_ <- 1..(d * n), do: -:rand.uniform() - 0.1), t), {d, n}, t}

    [
      Sample.random_triple({b, l, d}, t),
      delta,
      a,
      Sample.random_triple({b, l, n}, t),
      Sample.random_triple({b, l, n}, t)
    ]
  end

  defp runner(:cuda_resident, shape, n) do
    [u, delta, a, b, c] = Enum.map(inputs(shape, n), &FusedKernels.Buffer.upload/1)

    fn ->
      SelectiveScan.native(u, delta, a, b, c, backend: :cuda, out: :device)
      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(:cuda, {_, l, _} = shape, n) when l <= 60 do
    [u, delta, a, b, c] = inputs(shape, n)
    fn -> SelectiveScan.native(u, delta, a, b, c, backend: :cuda) end
  end

  defp runner(:cpu, {_, l, _} = shape, n) when l <= 60 do
    [u, delta, a, b, c] = inputs(shape, n)
    fn -> SelectiveScan.native(u, delta, a, b, c, backend: :cpu) end
  end

  defp runner(_, _, _), do: nil
end
