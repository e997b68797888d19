defmodule FusedKernels.Bench.Rnn do
  @moduledoc false
  alias FusedKernels.{Sample, Rnn}

  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    for cell <- [:lstm, :gru],
        {name, {b, t, i}, h, layers, type} <- [
          {"exphil B1 T60 I288 H256 x2", {1, 60, 288}, 256, 2, {:f, 32}},
          {"B64 T60 I288 H256 x2", {64, 60, 288}, 256, 2, {:f, 32}}
        ] do
      shape = {b, t, i}

      %{
        name: "#{cell} #{name}",
        shape: shape,
        type: type,
        runner: &runner(&1, cell, shape, h, layers, type)
      }
    end
  end

  defp params(cell, i, h, layers, type, wrap) do
    {ins, hids, bs} = FusedKernels.Rnn.gate_names(cell)

    for l <- 0..(layers - 1) do
      inp = if l == 0, do: i, else: h
      t = fn shape -> wrap.(scaled(shape, type, 0.5 / :math.sqrt(elem(shape, 0)))) end

      %{
        "input_kernel" => Map.new(ins, &{&1, t.({inp, h})}),
        "hidden_kernel" => Map.new(hids, &{&1, t.({h, h})}),
        "bias" => Map.new(bs, &{&1, t.({h})})
      }
    end
  end

  defp scaled(shape, type, scale) do
    values = for _ <- 1..Tuple.product(shape), do: (:rand.uniform() * 2 - 1) * scale
    {Sample.encode_values(values, type), shape, type}
  end

  defp runner(:cuda_resident, cell, shape, h, layers, type) do
    x = FusedKernels.Buffer.upload(Sample.random_triple(shape, type))
    ps = params(cell, elem(shape, 2), h, layers, type, &FusedKernels.Buffer.upload/1)

    fn ->
      Rnn.native(cell, x, ps, backend: :cuda, out: :device)
      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(backend, cell, shape, h, layers, type) when backend in [:cuda, :cpu] do
    x = Sample.random_triple(shape, type)
    ps = params(cell, elem(shape, 2), h, layers, type, & &1)

    if backend == :cpu and elem(shape, 0) > 1,
      do: nil,
      else: fn -> Rnn.native(cell, x, ps, backend: backend) end
  end

  defp runner(:nx, _cell, _shape, _h, _layers, _type), do: nil
end
