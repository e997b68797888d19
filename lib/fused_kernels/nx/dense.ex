if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Nx.Dense do
    @moduledoc """
    The pure-Nx implementation of `FusedKernels.Dense` (f32 arithmetic, f64 for f64; output in
    x's type); works on any Nx backend and inside `defn`.
    """

    @typep t :: FusedKernels.Tensor.nx()

    @doc """
    One fused dense layer of `kind` (`:dense`, `:swiglu`, `:rms_norm_dense`,
    `:layer_norm_dense`) over the operand slots `ops` (see `FusedKernels.Dense.nx/3`).
    """
    @spec nx(atom, map, keyword) :: t
    def nx(kind, ops, opts) do
      x = ops.x
      type = Nx.type(x)
      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      lead = x |> Nx.shape() |> Tuple.delete_at(Nx.rank(x) - 1)
      k = elem(Nx.shape(x), Nx.rank(x) - 1)
      check_shapes!(kind, ops, k)
      n = elem(Nx.shape(ops.kernel), 1)
      f = fn t -> Nx.as_type(t, compute) end
      a = x |> f.() |> Nx.reshape({:auto, k})

      a =
        case kind do
          :rms_norm_dense ->
            ms = a |> Nx.multiply(a) |> Nx.mean(axes: [-1], keep_axes: true)
            a |> Nx.multiply(Nx.rsqrt(Nx.add(ms, opts[:eps]))) |> Nx.multiply(f.(ops.gamma))

          :layer_norm_dense ->
            c = Nx.subtract(a, Nx.mean(a, axes: [-1], keep_axes: true))
            var = c |> Nx.multiply(c) |> Nx.mean(axes: [-1], keep_axes: true)

            c
            |> Nx.multiply(Nx.rsqrt(Nx.add(var, opts[:eps])))
            |> Nx.multiply(f.(ops.gamma))
            |> Nx.add(f.(ops.beta))

          _ ->
            a
        end

      plus = fn t, slot -> if b = Map.get(ops, slot), do: Nx.add(t, f.(b)), else: t end
      y = a |> Nx.dot(f.(ops.kernel)) |> plus.(:bias)

      y =
        if kind == :swiglu do
          up = a |> Nx.dot(f.(ops.kernel_up)) |> plus.(:bias_up)
          y |> Nx.multiply(Nx.sigmoid(y)) |> Nx.multiply(up)
        else
          activate(y, Keyword.get(opts, :activation, :none))
        end

      y =
        case Map.get(ops, :residual) do
          nil -> y
          r -> Nx.add(y, r |> f.() |> Nx.reshape({:auto, n}))
        end

      y |> Nx.as_type(type) |> Nx.reshape(Tuple.insert_at(lead, tuple_size(lead), n))
    end

    defp activate(y, :none), do: y
    defp activate(y, :relu), do: Nx.max(y, 0)
    defp activate(y, :sigmoid), do: Nx.sigmoid(y)
    defp activate(y, :tanh), do: Nx.tanh(y)
    defp activate(y, :silu), do: Nx.multiply(y, Nx.sigmoid(y))

    defp activate(y, :gelu),
      do: y |> Nx.multiply(0.5) |> Nx.multiply(Nx.add(1, Nx.erf(Nx.multiply(y, :math.sqrt(0.5)))))

    defp activate(y, :gelu_tanh) do
      inner = y |> Nx.pow(3) |> Nx.multiply(0.044715) |> Nx.add(y)
      u = Nx.multiply(inner, :math.sqrt(2 / :math.pi()))
      y |> Nx.multiply(0.5) |> Nx.multiply(Nx.add(1, Nx.tanh(u)))
    end

    # The native layer checks the same rules; here for the pure-Nx path.
    defp check_shapes!(kind, ops, k) do
      kernel_name = if kind == :swiglu, do: "w_gate", else: "kernel"
      gamma_name = if kind == :rms_norm_dense, do: "norm_weight", else: "gamma"
      bias_name = if kind == :swiglu, do: "bias_gate", else: "bias"

      case Nx.shape(ops.kernel) do
        {^k, _} ->
          :ok

        other ->
          raise ArgumentError,
                "#{kernel_name}: expected shape {#{k}, units} (rows = x's last dimension #{k}), got #{inspect(other)}"
      end

      n = elem(Nx.shape(ops.kernel), 1)
      out = x_out_shape(ops.x, n)

      for {slot, name, want} <- [
            {:kernel_up, "w_up", {k, n}},
            {:bias, bias_name, {n}},
            {:bias_up, "bias_up", {n}},
            {:gamma, gamma_name, {k}},
            {:beta, "beta", {k}},
            {:residual, "residual", out}
          ],
          t = Map.get(ops, slot),
          t != nil,
          Nx.shape(t) != want do
        raise ArgumentError,
              "#{name}: expected shape #{inspect(want)}, got #{inspect(Nx.shape(t))}"
      end

      :ok
    end

    defp x_out_shape(x, n), do: x |> Nx.shape() |> put_elem(Nx.rank(x) - 1, n)
  end
end
