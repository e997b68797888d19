if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.MambaBlock do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.MambaBlock`: a composition of plain Nx ops (f32
    inside), the norm and the scan those of `FusedKernels.Nx.Norm` and
    `FusedKernels.Nx.SelectiveScan`; works on any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc """
    One block over its 16 weights in `FusedKernels.MambaBlock.weights/2`'s order, from a carried
    state (see `FusedKernels.MambaBlock.nx_with_state/4`): `{out, next_state}`.
    """
    @spec nx_with_state(t, [t | nil], tuple | nil, keyword) :: {t, tuple | nil}
    def nx_with_state(x, weights, state, opts \\ []) do
      opts =
        Keyword.merge(
          [
            eps: 1.0e-5,
            dt_min: 0.001,
            dt_max: 0.1,
            b_discretization: :per_channel,
            residual: true
          ],
          opts
        )

      [
        gamma,
        beta,
        w_in,
        b_in,
        conv,
        b_conv,
        w_bc,
        b_bc,
        w_dtr,
        b_dtr,
        w_dtp,
        b_dtp,
        a,
        d,
        w_out,
        b_out
      ] =
        Enum.map(weights, fn
          nil -> nil
          t -> Nx.as_type(t, {:f, 32})
        end)

      type = Nx.type(x)
      seq = elem(Nx.shape(x), 1)
      x32 = Nx.as_type(x, {:f, 32})
      dense = fn t, w, b -> if b, do: Nx.add(Nx.dot(t, w), b), else: Nx.dot(t, w) end

      xn = FusedKernels.Nx.Norm.nx(:layer_norm, x32, gamma, beta, eps: opts[:eps])
      xz = dense.(xn, w_in, b_in)
      inner = div(elem(Nx.shape(xz), 2), 2)
      xs = xz[[.., .., 0..(inner - 1)]]
      z = xz[[.., .., inner..(2 * inner - 1)]]

      # Depthwise causal conv: tap j multiplies step t - (k-1) + j; the steps before the
      # chunk are the carried conv inputs, or zeros.
      taps =
        case Nx.shape(conv) do
          {k, 1, ^inner} -> Nx.reshape(conv, {k, inner})
          {^inner, 1, k} -> conv |> Nx.reshape({inner, k}) |> Nx.transpose()
        end

      k = elem(Nx.shape(taps), 0)

      inputs =
        case state do
          nil -> Nx.pad(xs, 0.0, [{0, 0, 0}, {k - 1, 0, 0}, {0, 0, 0}])
          {conv_state, _} -> Nx.concatenate([conv_state, xs], axis: 1)
        end

      conv_out =
        Enum.reduce(0..(k - 1), if(b_conv, do: b_conv, else: 0.0), fn j, acc ->
          Nx.add(acc, Nx.multiply(inputs[[.., j..(j + seq - 1)]], taps[j]))
        end)

      xc = Nx.multiply(conv_out, Nx.sigmoid(conv_out))
      bc = dense.(xc, w_bc, b_bc)
      n = div(elem(Nx.shape(bc), 2), 2)
      dt = xc |> dense.(w_dtr, b_dtr) |> Nx.dot(w_dtp)
      a = a || Nx.negate(Nx.add(Nx.iota({inner, n}, axis: 1, type: {:f, 32}), 1))

      scan_opts = [
        d: d,
        z: z,
        delta_bias: b_dtp,
        delta_softplus: true,
        delta_clip: {opts[:dt_min], opts[:dt_max]},
        b_discretization: opts[:b_discretization]
      ]

      scan =
        &FusedKernels.Nx.SelectiveScan.nx(
          xc,
          dt,
          a,
          bc[[.., .., 0..(n - 1)]],
          bc[[.., .., n..(2 * n - 1)]],
          &1
        )

      {y, next} =
        case state do
          nil ->
            {scan.(scan_opts), nil}

          {_, ssm_state} ->
            {y, last} = scan.(scan_opts ++ [initial_state: ssm_state, return_last_state: true])
            {y, {inputs[[.., seq..-1//1]], last}}
        end

      out = dense.(y, w_out, b_out)
      out = if opts[:residual], do: Nx.add(out, x32), else: out
      {Nx.as_type(out, type), next}
    end
  end
end
