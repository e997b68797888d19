if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.Rnn do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.Rnn`: Axon's cell equations with f32 arithmetic
    (f64 for f64), outputs in the input type; any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc "A stack of LSTM or GRU layers (see `FusedKernels.Rnn.nx/4`): `{sequence, states}`."
    @spec nx(:lstm | :gru, t, list, boolean) :: {t, [tuple]}
    def nx(cell, x, layers, reverse) do
      type = Nx.type(x)
      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      up = &Nx.as_type(Nx.to_tensor(&1), compute)

      {seq, states} =
        Enum.reduce(layers, {up.(x), []}, fn {wi, wh, bs, state}, {input, acc} ->
          {b, _t, _} = Nx.shape(input)
          units = elem(Nx.shape(hd(wh)), 0)
          zeros = Nx.broadcast(Nx.tensor(0, type: compute), {b, units})
          input = if reverse, do: Nx.reverse(input, axes: [1]), else: input

          carry =
            case {cell, Enum.map(state, up)} do
              {:lstm, [c, h]} -> {c, h}
              {:lstm, []} -> {zeros, zeros}
              {:gru, [h]} -> {h}
              {:gru, []} -> {zeros}
            end

          xp = Enum.map(wi, fn w -> Nx.dot(input, [2], up.(w), [0]) end)

          args =
            {List.to_tuple(xp), List.to_tuple(Enum.map(wh, up)), List.to_tuple(Enum.map(bs, up))}

          {seq, carry} = FusedKernels.Nx.Rnn.Scan.scan(args, carry, cell: cell)
          seq = if reverse, do: Nx.reverse(seq, axes: [1]), else: seq
          {seq, [carry | acc]}
        end)

      cast = &Nx.as_type(&1, type)

      {cast.(seq),
       states
       |> Enum.reverse()
       |> Enum.map(&(&1 |> Tuple.to_list() |> Enum.map(cast) |> List.to_tuple()))}
    end
  end

  defmodule FusedKernels.Nx.Rnn.Scan do
    @moduledoc false
    # The time loop of the pure-Nx path as a defn `while`, so it works eagerly on any backend
    # and inside defn without unrolling. Inputs are f32/f64; `xp` holds x . W per gate.
    import Nx.Defn

    @spec scan(tuple, tuple, keyword) :: {Nx.Tensor.t(), tuple}
    defn scan(args, carry, opts \\ []) do
      {xp, wh, bs} = args
      x0 = elem(xp, 0)
      {b, t, h} = Nx.shape(x0)
      seq = Nx.broadcast(Nx.tensor(0, type: Nx.type(x0)), {b, t, h})

      {_, seq, carry, _} =
        while {s = 0, seq, carry, args}, s < t do
          {new_h, carry} = step(args, carry, s, opts[:cell])
          {s + 1, Nx.put_slice(seq, [0, s, 0], Nx.new_axis(new_h, 1)), carry, args}
        end

      _ = {wh, bs}
      {seq, carry}
    end

    deftransformp step({xp, wh, bs}, carry, s, cell) do
      at = fn x -> x |> Nx.slice_along_axis(s, 1, axis: 1) |> Nx.squeeze(axes: [1]) end
      sig = &Nx.sigmoid/1
      dense_h = fn h, w -> Nx.dot(h, w) end

      case cell do
        :lstm ->
          {c, h} = carry

          pre = fn g ->
            Nx.add(Nx.add(at.(elem(xp, g)), elem(bs, g)), dense_h.(h, elem(wh, g)))
          end

          {i, f, g, o} = {sig.(pre.(0)), sig.(pre.(1)), Nx.tanh(pre.(2)), sig.(pre.(3))}
          new_c = Nx.add(Nx.multiply(f, c), Nx.multiply(i, g))
          new_h = Nx.multiply(o, Nx.tanh(new_c))
          {new_h, {new_c, new_h}}

        :gru ->
          {h} = carry

          pre = fn g ->
            Nx.add(Nx.add(at.(elem(xp, g)), elem(bs, g)), dense_h.(h, elem(wh, g)))
          end

          {r, z} = {sig.(pre.(0)), sig.(pre.(1))}

          n =
            Nx.tanh(
              Nx.add(
                Nx.add(at.(elem(xp, 2)), elem(bs, 2)),
                Nx.multiply(r, Nx.add(dense_h.(h, elem(wh, 2)), elem(bs, 3)))
              )
            )

          new_h = Nx.add(Nx.multiply(Nx.subtract(1, z), n), Nx.multiply(z, h))
          {new_h, {new_h}}
      end
    end
  end
end
